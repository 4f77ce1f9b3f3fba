from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from dlo_test_models import assert_state_identical, make_model, make_two_list_model
from safetensors.torch import save_file

from dlo_offload import OffloadPlan, build_checkpoint_mmap_plan, enable_layerwise_offload, load_checkpoint

PLAN = OffloadPlan("blocks", resident_blocks=1, resident_modules=("embed", "head"))


def _save(model: torch.nn.Module, directory: Path, *, shards: int = 2) -> dict[str, torch.Tensor]:
    """Save like a sharded HF checkpoint: blocks split over files, plus an index."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = {k: state[k] for k in names[i::shards]}
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(directory / file_name))
        weight_map.update({k: file_name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def _meta_model(model: torch.nn.Module | None = None, prefixes: tuple[str, ...] = ("blocks.",)) -> torch.nn.Module:
    model = make_model() if model is None else model
    block_state = {k for k in model.state_dict() if k.startswith(prefixes)}
    for name in block_state:  # the block tensors stay unloaded, as a meta-initialised model would have them
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        table[attr] = (
            torch.nn.Parameter(torch.empty_like(table[attr], device="meta"), requires_grad=False)
            if attr in owner._parameters
            else torch.empty_like(table[attr], device="meta")
        )
    return model


def test_preflight_success_maps_blocks_and_output_is_exact(tmp_path: Path) -> None:
    reference = make_model()
    _save(reference, tmp_path)
    model = _meta_model()
    result = load_checkpoint(model, PLAN, tmp_path)
    assert result.fallback_reason is None and result.plan is not None
    assert result.plan.backing_kind == "checkpoint_mmap"
    assert set(result.plan.bindings) == {k for k in reference.state_dict() if k.startswith("blocks.")}
    assert model.blocks[3].qkv.weight.is_meta and not model.embed.weight.is_meta
    handle = enable_layerwise_offload(model, PLAN, device="cpu", host_weights=result.plan)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
    handle.remove()
    assert_state_identical(model, reference)  # FP8 transposed weight comes back with its stride


def test_preflight_covers_several_block_lists(tmp_path: Path) -> None:
    reference = make_two_list_model()
    _save(reference, tmp_path)
    plan = OffloadPlan(("double_blocks", "single_blocks"), resident_blocks=2, resident_modules=("embed", "head"))
    model = _meta_model(make_two_list_model(), ("double_blocks.", "single_blocks."))
    result = load_checkpoint(model, plan, tmp_path)
    assert result.fallback_reason is None and result.plan is not None
    assert result.plan.planned_prefixes == {"double_blocks.", "single_blocks."}
    assert set(result.plan.bindings) == {k for k in reference.state_dict() if "blocks." in k}
    handle = enable_layerwise_offload(model, plan, device="cpu", host_weights=result.plan, use_allgather=False)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    handle.remove()
    # A checkpoint without the second list's tensors cannot back the plan; the reason names both prefixes.
    (tmp_path / "partial").mkdir()
    save_file(
        {k: v.contiguous() for k, v in reference.state_dict().items() if not k.startswith("single_blocks.")},
        str(tmp_path / "partial" / "model.safetensors"),
    )
    result = build_checkpoint_mmap_plan(make_two_list_model(), plan, tmp_path / "partial")
    assert result.plan is None and "required block tensors have no checkpoint binding" in result.fallback_reason
    assert "single_blocks.0" in result.fallback_reason


def _fallback(tmp_path: Path, model: torch.nn.Module, checkpoint: object, caplog: pytest.LogCaptureFixture) -> str:
    before = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="dlo_offload.checkpoint"):
        result = build_checkpoint_mmap_plan(model, PLAN, checkpoint)  # type: ignore[arg-type]
    assert result.plan is None and result.fallback_reason
    assert f"DLO direct checkpoint mmap unavailable; using ordinary loader: {result.fallback_reason}" in caplog.text
    after = model.state_dict()
    assert before.keys() == after.keys() and all(
        after[k] is not None
        and torch.equal(
            before[k].view(torch.uint8) if before[k].dtype == torch.float8_e4m3fn else before[k],
            after[k].view(torch.uint8) if after[k].dtype == torch.float8_e4m3fn else after[k],
        )
        for k in before
    )
    return result.fallback_reason


def test_fallback_reasons(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}

    def write(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = tmp_path / name
        save_file(tensors, str(path))
        return path

    assert "checkpoint file does not exist" in _fallback(tmp_path, model, tmp_path / "absent.safetensors", caplog)
    (tmp_path / "empty").mkdir()
    assert "no safetensors files were found" in _fallback(tmp_path, model, tmp_path / "empty", caplog)

    missing = dict(state)
    del missing["blocks.2.mlp.0.weight"]
    reason = _fallback(tmp_path, model, write("missing.safetensors", missing), caplog)
    assert reason == "1 required block tensors have no checkpoint binding (first 5: ['blocks.2.mlp.0.weight'])"

    extra = dict(state, **{"blocks.1.extra.weight": torch.zeros(2)})
    reason = _fallback(tmp_path, model, write("extra.safetensors", extra), caplog)
    assert "1 checkpoint entries under 'blocks.' match no block tensor (first 5: ['blocks.1.extra.weight'])" == reason

    shape = dict(state, **{"blocks.0.gate": torch.zeros(31)})
    reason = _fallback(tmp_path, model, write("shape.safetensors", shape), caplog)
    assert reason == "shape mismatch for 'blocks.0.gate': checkpoint=[31], runtime=[32]"

    dtype = dict(state, **{"blocks.4.proj.weight": state["blocks.4.proj.weight"].to(torch.bfloat16)})
    reason = _fallback(tmp_path, model, write("dtype.safetensors", dtype), caplog)
    assert reason == "dtype mismatch for 'blocks.4.proj.weight': checkpoint=torch.bfloat16, runtime=torch.float8_e4m3fn"

    first = write("dup-a.safetensors", state)
    second = write("dup-b.safetensors", {"blocks.0.gate": state["blocks.0.gate"]})
    reason = _fallback(tmp_path, model, [first, second], caplog)
    assert reason.startswith("multiple checkpoint entries map to runtime tensor 'blocks.0.gate'")

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert _fallback(tmp_path, model, corrupt, caplog)


def test_remap_translates_checkpoint_keys(tmp_path: Path) -> None:
    reference = make_model()
    state = {k.replace("blocks.", "transformer_blocks."): v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    result = build_checkpoint_mmap_plan(
        make_model(seed=7), PLAN, tmp_path, remap=lambda key: key.replace("transformer_blocks.", "blocks.")
    )
    assert result.plan is not None
    assert result.plan.bindings["blocks.1.qkv.weight"].checkpoint_key == "transformer_blocks.1.qkv.weight"


def test_ordinary_fallback_loads_everything(tmp_path: Path) -> None:
    reference = make_model()
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    state["blocks.0.gate"] = state["blocks.0.gate"].double()  # a dtype mismatch forces the ordinary path
    save_file(state, str(tmp_path / "model.safetensors"))
    model = make_model(seed=3)
    result = load_checkpoint(model, PLAN, tmp_path)
    assert result.plan is None and "dtype mismatch for 'blocks.0.gate'" in (result.fallback_reason or "")
    assert model.blocks[0].gate.dtype == torch.float64  # assign=True loads what the file holds
    assert torch.equal(model.blocks[3].qkv.weight, reference.blocks[3].qkv.weight)


def test_load_rejects_a_checkpoint_missing_non_block_tensors(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in make_model().state_dict().items() if not k.startswith("head.")}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        RuntimeError, match=r"checkpoint does not match the model: missing \['head.bias', 'head.weight'\]"
    ):
        load_checkpoint(make_model(), PLAN, tmp_path)


def test_a_host_weight_plan_for_another_layout_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    import dataclasses

    reference = make_model()
    _save(reference, tmp_path)
    result = build_checkpoint_mmap_plan(make_model(), PLAN, tmp_path)
    assert result.plan is not None
    other = make_model(hidden=16)  # same names, other shapes
    before = {k: v.clone() for k, v in other.state_dict().items() if v.dtype != torch.float8_e4m3fn}
    with pytest.raises(
        ValueError, match=r"host_weights binds blocks\.1\.norm\.weight to a torch\.float32 tensor of shape \(32,\)"
    ):
        enable_layerwise_offload(other, PLAN, device="cpu", host_weights=result.plan)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert not other.blocks[1]._forward_pre_hooks
    bogus = dataclasses.replace(result.plan, backing_kind="network")
    with pytest.raises(ValueError, match="Unsupported DLO host-weight backing: network"):
        enable_layerwise_offload(make_model(), PLAN, device="cpu", host_weights=bogus)


def test_streaming_from_the_checkpoint_keeps_no_private_block_copy(tmp_path: Path) -> None:
    reference = make_model()
    _save(reference, tmp_path)
    model = _meta_model()
    result = load_checkpoint(model, PLAN, tmp_path)
    handle = enable_layerwise_offload(model, PLAN, device="cpu", host_weights=result.plan, stream_from_checkpoint=True)
    assert handle.streams_from_checkpoint and handle.host_block_buffers == ()
    assert handle.host_nbytes <= 2 * handle.slot_nbytes  # two staging buffers, not one copy per block
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)
        assert torch.equal(model.blocks[3](x), reference.blocks[3](x))  # out of order, through staging too
    handle.remove()
    assert_state_identical(model, reference)


def test_streaming_from_the_checkpoint_needs_a_plan_and_rank_local_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stream_from_checkpoint=True needs host_weights="):
        enable_layerwise_offload(make_model(), PLAN, device="cpu", stream_from_checkpoint=True)
