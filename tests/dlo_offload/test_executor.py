from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dlo_test_models import assert_state_identical, make_model, make_two_list_model, tensor_bytes
from torch import nn

from dlo_offload import LayerwiseOffload, OffloadPlan, SlotState, allocate_host_bytes, enable_layerwise_offload

HIDDEN = 32


def _reference(num_blocks: int = 5) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    model = make_model(hidden=HIDDEN, num_blocks=num_blocks)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(x)
    return model, reference, x, expected


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("resident_blocks", [0, 1, 2])
def test_offloaded_output_equals_resident_output_exactly(num_blocks: int, resident_blocks: int) -> None:
    model, reference, x, expected = _reference(num_blocks)
    plan = OffloadPlan("blocks", resident_blocks=resident_blocks, resident_modules=("embed", "head"))
    handle = enable_layerwise_offload(model, plan, device="cpu")
    with torch.inference_mode():
        for _ in range(3):  # repeated forwards wrap the circular prefetch around
            assert torch.equal(model(x), expected)
    handle.remove()
    assert_state_identical(model, reference)


@pytest.mark.parametrize("resident_blocks", [0, 2, 3, 4, 7])
def test_two_block_lists_stream_in_execution_order_with_exact_output(resident_blocks: int) -> None:
    model = make_two_list_model(hidden=HIDDEN, num_double=3, num_single=4)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(x)
    plan = OffloadPlan(
        ("double_blocks", "single_blocks"), resident_blocks=resident_blocks, resident_modules=("embed", "head")
    )
    handle = enable_layerwise_offload(model, plan, device="cpu")
    streamed = [
        name for name, module in model.named_modules() if module in (*model.double_blocks, *model.single_blocks)
    ][resident_blocks:]
    assert [block.name for block in handle._streamed] == streamed
    # Each slot holds the largest streamed block, whichever list it comes from.
    sizes = [
        sum(t.numel() * t.element_size() for t in b.parameters())
        for b in (*reference.double_blocks, *reference.single_blocks)
    ]
    assert handle.slot_nbytes >= max(sizes[resident_blocks:], default=0)
    loaded: list[str] = []
    hooks = [
        block.register_forward_pre_hook(lambda module, args, name=name: loaded.append(name))
        for name, block in model.named_modules()
        if name.count(".") == 1 and "blocks." in name
    ]
    with torch.inference_mode():
        for _ in range(3):  # the circular prefetch wraps from the last single block to the first streamed one
            assert torch.equal(model(x), expected)
    for hook in hooks:
        hook.remove()
    one_forward = [f"double_blocks.{i}" for i in range(3)] + [f"single_blocks.{i}" for i in range(4)]
    assert loaded == one_forward * 3
    handle.remove()
    assert_state_identical(model, reference)


def test_slots_move_through_named_states_and_never_reload_a_running_block() -> None:
    model, _, x, expected = _reference(3)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks", resident_modules=("embed", "head")), device="cpu")
    assert [(s.state, s.tenant) for s in handle._slots] == [(SlotState.FILLED, 0), (SlotState.EMPTY, None)]
    seen = []

    def record(module: nn.Module, args: object) -> None:  # runs after the offload's own pre-hook
        seen.append([(s.state, s.tenant) for s in handle._slots])

    hooks = [block.register_forward_pre_hook(record) for block in model.blocks]
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    for h in hooks:
        h.remove()
    computing, filled = SlotState.COMPUTING, SlotState.FILLED
    assert seen == [
        [(computing, 0), (filled, 1)],  # block 0 runs from slot 0 while block 1 is copied into slot 1
        [(filled, 2), (computing, 1)],  # block 2 goes into slot 0 once block 0 released it
        [(computing, 2), (filled, 0)],  # the prefetch wraps around to block 0 for the next forward
    ]
    # A streamed block that calls another one would make the offload overwrite a running block's slot.
    blocks = model.blocks
    original_forward = blocks[0].forward
    blocks[0].forward = lambda h: blocks[1](original_forward(h))  # type: ignore[method-assign]
    overwrite = r"would overwrite slot \d while blocks.0 runs from it to load blocks.2"
    with pytest.raises(RuntimeError, match=overwrite), torch.inference_mode():
        model(x)
    del blocks[0].forward
    with torch.inference_mode():  # the failed forward left both slots reusable
        assert torch.equal(model(x), expected)
    handle.remove()


def test_a_profiler_trace_names_each_blocks_copy_and_forward() -> None:
    model, _, x, _ = _reference(3)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks", resident_modules=("embed", "head")), device="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace, torch.inference_mode():
        model(x)
    names = [event.name for event in trace.events()]
    handle.remove()
    for k in range(3):
        assert names.count(f"dlo_offload.forward blocks.{k}") == 1
    # Blocks 1 and 2 are prefetched during this forward, block 0 for the next one (block 0's first copy
    # happened at enable time, before the trace).
    assert [n for n in names if n.startswith("dlo_offload.h2d")] == [
        "dlo_offload.h2d blocks.1",
        "dlo_offload.h2d blocks.2",
        "dlo_offload.h2d blocks.0",
    ]


def test_streamed_blocks_live_only_in_the_two_slots() -> None:
    model, _, x, _ = _reference(5)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks", resident_modules=("embed", "head")), device="cpu")
    slot_ptrs = {slot.buffer.untyped_storage().data_ptr() for slot in handle._slots}
    assert len(slot_ptrs) == 2
    seen_slots: list[int] = []

    def record(module: nn.Module, args: object) -> None:
        storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        assert len(storages) == 1 and storages <= slot_ptrs  # every tensor of the block is a slot view
        seen_slots.append(storages.pop())

    hooks = [block.register_forward_pre_hook(record) for block in model.blocks]
    with torch.inference_mode():
        model(x)
        model(x)
    for h in hooks:
        h.remove()
    # Two slots alternate between consecutive blocks, so slots are reused every other block.
    assert all(a != b for a, b in zip(seen_slots, seen_slots[1:5], strict=False))
    assert len(set(seen_slots)) == 2
    # Between forwards, streamed blocks hold no weight bytes at all.
    assert all(p.numel() == 0 for block in model.blocks for p in block.parameters())
    largest = max(sum(t.numel() * t.element_size() for t in b.parameters()) for b in make_model(hidden=HIDDEN).blocks)
    assert handle.slot_nbytes >= largest
    handle.remove()


def test_resident_blocks_and_modules_stay_on_device_untouched() -> None:
    model, _, x, _ = _reference(4)
    embed_weight = model.embed.weight
    handle = enable_layerwise_offload(
        model, OffloadPlan("blocks", resident_blocks=2, resident_modules=("embed",)), device="cpu"
    )
    assert model.embed.weight is embed_weight  # parameter identity kept
    assert model.blocks[0].qkv.weight.numel() > 0 and model.blocks[1].qkv.weight.numel() > 0
    assert model.blocks[2].qkv.weight.numel() == 0 and model.blocks[3].qkv.weight.numel() == 0
    assert handle.resident_nbytes > 0
    handle.remove()


def test_out_of_order_block_call_loads_it_synchronously() -> None:
    model, reference, x, _ = _reference(5)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks"), device="cpu")
    with torch.inference_mode():
        for index in (3, 1, 4, 0, 2, 2):
            assert torch.equal(model.blocks[index](x), reference.blocks[index](x))
    handle.remove()


def test_fp8_and_every_dtype_round_trip_through_the_slots_bit_exactly() -> None:
    model, reference, _, _ = _reference(3)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks"), device="cpu")
    captured: dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], bytes]] = {}

    def capture(module: nn.Module, args: object) -> None:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            captured[name] = (t.dtype, tuple(t.shape), t.stride(), tensor_bytes(t))

    hook = model.blocks[1].register_forward_pre_hook(capture)
    with torch.inference_mode():
        model(torch.randn(1, 3, HIDDEN))
    hook.remove()
    want = dict(reference.blocks[1].named_parameters()) | dict(reference.blocks[1].named_buffers())
    assert captured.keys() == want.keys()
    for name, t in want.items():
        assert captured[name] == (t.dtype, tuple(t.shape), t.stride(), tensor_bytes(t)), name
    assert captured["proj.weight"][0] == torch.float8_e4m3fn and captured["proj.weight"][2] == (1, HIDDEN)
    handle.remove()


def test_gradients_enabled_is_refused_with_a_clear_error() -> None:
    model, _, x, _ = _reference(3)
    model.blocks.requires_grad_(True)
    model.blocks[0].proj.weight.requires_grad_(False)  # FP8 cannot require grad
    handle = enable_layerwise_offload(model, OffloadPlan("blocks", resident_modules=("embed", "head")), device="cpu")
    with pytest.raises(RuntimeError, match="inference-only"):
        model(x)
    with torch.no_grad():
        model(x)  # the failed call left the executor usable
    handle.remove()


def test_failed_enable_leaves_the_model_unchanged() -> None:
    model, reference, _, _ = _reference(3)
    model.blocks[2].gate = torch.empty(HIDDEN, device="meta")  # an unloaded tensor in a streamed block
    reference.blocks[2].gate = torch.empty(HIDDEN, device="meta")
    with pytest.raises(ValueError, match=r"blocks\.2\.gate is on the meta device"):
        enable_layerwise_offload(model, OffloadPlan("blocks", resident_modules=("embed",)), device="cpu")
    assert not model.blocks[0]._forward_pre_hooks
    for name, t in reference.state_dict().items():
        got = model.state_dict()[name]
        assert got.shape == t.shape and (t.is_meta or tensor_bytes(got) == tensor_bytes(t)), name


def test_remove_is_idempotent_and_restores_parameter_identity() -> None:
    model, reference, x, expected = _reference(3)
    qkv = model.blocks[1].qkv.weight
    handle = enable_layerwise_offload(model, OffloadPlan("blocks"), device="cpu")
    handle.remove()
    handle.remove()
    assert model.blocks[1].qkv.weight is qkv
    assert not model.blocks[1]._forward_pre_hooks and not model.blocks[1]._forward_hooks
    assert_state_identical(model, reference)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


def test_unsupported_device_is_rejected_before_touching_the_model() -> None:
    model, reference, _, _ = _reference(2)
    with pytest.raises(ValueError, match="supports 'cuda' and 'cpu'"):
        enable_layerwise_offload(model, OffloadPlan("blocks"), device="meta")
    assert_state_identical(model, reference)


def test_refused_pin_falls_back_to_pageable_memory_with_a_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("pinning is allowed on this host; the refusal path needs a CPU-only torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffer, pinned = allocate_host_bytes(1024, pin=True)
    assert not pinned and buffer.numel() == 1024 and not buffer.is_pinned()
    assert any("falling back to pageable" in str(w.message) for w in caught)


def test_handle_reports_mode_and_sizes() -> None:
    model, _, _, _ = _reference(4)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks", resident_blocks=1), device="cpu")
    assert isinstance(handle, LayerwiseOffload)
    assert (handle.mode, handle.world_size, handle.rank, handle.pinned) == ("rank_local", 1, 0, False)
    # Three identical streamed blocks: the host holds each once, a slot holds exactly one.
    assert handle.host_nbytes == 3 * handle.slot_nbytes
    block = make_model(hidden=HIDDEN).blocks[0]
    block_bytes = sum(t.numel() * t.element_size() for t in [*block.parameters(), *block.buffers()])
    assert block_bytes <= handle.slot_nbytes < block_bytes + 256 * 16  # at most one alignment pad per tensor
    handle.remove()
