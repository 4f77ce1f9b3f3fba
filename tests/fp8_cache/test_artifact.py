"""Cache artifact: the seed's contract tests, plus staleness, corruption, path escape, publication."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_cache import (
    CACHE_COMPLETE_NAME,
    CACHE_INDEX_NAME,
    CACHE_KIND,
    CACHE_MANIFEST_NAME,
    FP8_DTYPE,
    QUANTIZATION_CONTRACT,
    build_fp8_cache,
    check_artifact,
    load_fp8_cache_manifest,
    load_fp8_weights,
    verify_artifact,
)
from fp8_cache.artifact import complete_marker, dump_json

from .conftest import make_component, same_tensors

QUANTIZED = [
    "blocks.0.attn.qkv.weight",
    "blocks.0.mlp.fc1.weight",
    "blocks.0.mlp.fc2.weight",
    "blocks.1.attn.qkv.weight",
    "blocks.1.mlp.fc1.weight",
    "blocks.1.mlp.fc2.weight",
]


@pytest.fixture
def built(component: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    result = build_fp8_cache(component, cache, ignore=["embed"], max_shard_bytes=8 * 1024)
    return cache, result.manifest


def _editable(manifest) -> dict:
    """The manifest as plain JSON data, to edit and write back with ``_rewrite_manifest``."""
    return msgspec.to_builtins(manifest)


def _rewrite_manifest(cache: Path, manifest: dict) -> None:
    """Rewrite the manifest *with* a matching COMPLETE marker, so only the edited field can cause a miss."""
    data = dump_json(manifest)
    (cache / CACHE_MANIFEST_NAME).write_bytes(data)
    (cache / CACHE_COMPLETE_NAME).write_text(complete_marker(data))


def _shards(cache: Path) -> list[Path]:
    return sorted((cache / "transformer").glob("*.safetensors"))


# --- the seed's tests, on our artifact ---------------------------------------------------------------


def test_valid_cache_returns_manifest_and_source_change_makes_it_stale(built, component):
    cache, manifest = built
    assert load_fp8_cache_manifest(cache) == manifest
    assert manifest.cache_kind == CACHE_KIND and list(manifest.quantized_tensors) == QUANTIZED
    source = sorted(component.glob("*.safetensors"))[0]
    source.write_bytes(source.read_bytes() + b"changed")
    assert load_fp8_cache_manifest(cache) is None
    assert "stale" in check_artifact(cache)[1]


def test_wrong_serialization_contract_is_a_miss(built):
    cache, manifest = built
    manifest = _editable(manifest)
    manifest["quantization"] = {**manifest["quantization"], "weight_layout": "in_out"}
    _rewrite_manifest(cache, manifest)
    assert load_fp8_cache_manifest(cache) is None
    assert "quantization contract" in check_artifact(cache)[1]
    manifest["quantization"] = {**manifest["quantization"], "weight_layout": "out_in", "extra": 1}
    _rewrite_manifest(cache, manifest)
    assert "unknown field `extra` - at `$.quantization`" in check_artifact(cache)[1]


def test_the_quantization_contract_is_immutable():
    with pytest.raises(AttributeError):
        QUANTIZATION_CONTRACT.weight_layout = "in_out"  # type: ignore[misc]
    assert msgspec.to_builtins(QUANTIZATION_CONTRACT)["weight_layout"] == "out_in"


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors", ".."])
def test_shard_names_that_escape_the_directory_are_rejected(built, escape):
    cache, manifest = built
    (cache / "outside.safetensors").write_bytes(_shards(cache)[0].read_bytes())
    index_path = cache / "transformer" / CACHE_INDEX_NAME
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    old = index["weight_map"][first]
    index["weight_map"][first] = escape
    index_path.write_text(json.dumps(index))
    assert load_fp8_cache_manifest(cache) is None
    # Even when the manifest is edited consistently, the escaping shard name itself is refused.
    index["weight_map"] = {n: (escape if f == old else f) for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    manifest = _editable(manifest)
    manifest["shards"][escape] = manifest["shards"].pop(old)
    _rewrite_manifest(cache, manifest)
    manifest_out, reason = check_artifact(cache)
    assert manifest_out is None and "does not match its schema" in reason and "`$.shards`" in reason


def test_non_object_manifest_is_a_miss(built):
    cache, _ = built
    _rewrite_manifest(cache, [])  # type: ignore[arg-type]
    assert load_fp8_cache_manifest(cache) is None
    assert "Expected `object`, got `array`" in check_artifact(cache)[1]


def test_build_serializes_fp8_weight_out_in_and_float32_scale(component, tmp_path):
    cache = tmp_path / "cache"
    manifest = build_fp8_cache(component, cache, ignore=["embed"]).manifest
    assert manifest.cache_kind == CACHE_KIND
    stored = {}
    for shard in _shards(cache):
        stored.update(load_file(str(shard)))
    source = {}
    for f in component.glob("*.safetensors"):
        source.update(load_file(str(f)))
    qkv = stored["blocks.0.attn.qkv.weight"]
    assert qkv.dtype == FP8_DTYPE and tuple(qkv.shape) == (96, 32)  # [out, in], like nn.Linear.weight
    scale = stored["blocks.0.attn.qkv.weight_scale"]
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert torch.equal(scale, source["blocks.0.attn.qkv.weight"].float().abs().max() / 448.0)
    # Unquantized tensors are the source bytes unchanged.
    for name in ("embed.weight", "head.weight", "blocks.0.norm.weight", "pos_ids", "blocks.0.attn.qkv.bias"):
        assert torch.equal(stored[name], source[name])


@pytest.mark.parametrize("missing", [CACHE_COMPLETE_NAME, CACHE_MANIFEST_NAME])
def test_missing_completion_marker_or_manifest_is_a_miss(built, missing):
    cache, _ = built
    (cache / missing).unlink()
    assert load_fp8_cache_manifest(cache) is None


# --- hit / miss semantics ------------------------------------------------------------------------------------


def test_hit_is_bit_identical_to_online_quantization(built, component):
    cache, _ = built
    hit = load_fp8_weights(component, cache, device="cpu", ignore=["embed"])
    online = load_fp8_weights(component, None, device="cpu", ignore=["embed"])
    assert hit.hit and not online.hit
    assert same_tensors(hit.tensors, online.tensors)
    assert hit.tensors["blocks.1.mlp.fc2.weight"].dtype == FP8_DTYPE


def test_miss_quantizes_online_and_publishes(component, tmp_path):
    cache = tmp_path / "cache"
    first = load_fp8_weights(component, cache, device="cpu", ignore=["embed"])
    assert not first.hit and first.published is True and "does not exist" in first.reason
    second = load_fp8_weights(component, cache, device="cpu", ignore=["embed"])
    assert second.hit and same_tensors(first.tensors, second.tensors)
    assert verify_artifact(cache)[1] == "ok"


def test_changed_ignore_patterns_are_a_miss_and_the_artifact_is_replaced(built, component):
    cache, _ = built
    result = load_fp8_weights(component, cache, device="cpu", ignore=["embed", "blocks.1.*"])
    assert not result.hit and "ignore patterns changed" in result.reason and result.published
    assert "blocks.1.mlp.fc1.weight" not in load_fp8_cache_manifest(cache).quantized_tensors
    assert result.tensors["blocks.1.mlp.fc1.weight"].dtype == torch.bfloat16


def test_failed_publication_warns_and_serving_goes_on(component, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache's parent directory should be")
    with caplog.at_level(logging.WARNING, logger="fp8_cache.load"):
        result = load_fp8_weights(component, blocker / "cache", device="cpu", ignore=["embed"])
    assert not result.hit and result.published is False
    assert "publishing the FP8 cache" in caplog.text
    assert result.tensors["blocks.0.mlp.fc1.weight"].dtype == FP8_DTYPE


def test_stale_artifact_is_replaced_atomically_by_the_next_build(built, component, tmp_path):
    cache, old_manifest = built
    make_component(component, seed=1)  # rewrite the sources: new contents, sizes equal, mtimes change
    for f in component.glob("*.safetensors"):
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert load_fp8_cache_manifest(cache) is None
    result = build_fp8_cache(component, cache, ignore=["embed"])
    assert result.action == "published"
    assert result.manifest.source_fingerprint != old_manifest.source_fingerprint
    assert load_fp8_cache_manifest(cache) == result.manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache.lock", "cache", "source"]


def test_build_is_idempotent(built, component):
    cache, manifest = built
    again = build_fp8_cache(component, cache, ignore=["embed"], max_shard_bytes=8 * 1024)
    assert again.action == "already_valid" and again.manifest == manifest


def test_non_cache_directory_is_never_replaced(component, tmp_path):
    cache = tmp_path / "precious"
    cache.mkdir()
    (cache / "notes.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not an FP8 cache artifact"):
        build_fp8_cache(component, cache)
    assert (cache / "notes.txt").read_text() == "user data"
    assert not list(tmp_path.glob(".precious.tmp-*"))


def test_abandoned_temporary_directories_of_dead_processes_are_swept(component, tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max, so no live process has it
    leftover = tmp_path / f".cache.tmp-{dead_pid}-deadbeef"
    (leftover / "transformer").mkdir(parents=True)
    live = tmp_path / f".cache.tmp-{os.getpid()}-cafe"  # our own pid: in use, kept
    live.mkdir()
    build_fp8_cache(component, tmp_path / "cache")
    assert not leftover.exists() and live.exists()


# --- corruption of each file kind ----------------------------------------------------------------------------


def _corrupt_manifest(cache: Path) -> None:
    (cache / CACHE_MANIFEST_NAME).write_bytes(b"{ not json")


def _corrupt_complete(cache: Path) -> None:
    (cache / CACHE_COMPLETE_NAME).write_text("phase1\n")


def _corrupt_index(cache: Path) -> None:
    (cache / "transformer" / CACHE_INDEX_NAME).write_bytes(b"\x00\x01garbage")


def _truncate_shard(cache: Path) -> None:
    shard = _shards(cache)[0]
    shard.write_bytes(shard.read_bytes()[:-3])


def _corrupt_shard_header(cache: Path) -> None:
    shard = _shards(cache)[0]
    data = bytearray(shard.read_bytes())
    data[10:14] = b"\xff\xfe\xfd\xfc"  # inside the JSON header, same size
    shard.write_bytes(bytes(data))


def _delete_shard(cache: Path) -> None:
    _shards(cache)[-1].unlink()


def _index_lists_an_extra_tensor(cache: Path) -> None:
    index_path = cache / "transformer" / CACHE_INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = _shards(cache)[0].name
    index_path.write_text(json.dumps(index))


def _index_total_size_wrong(cache: Path) -> None:
    index_path = cache / "transformer" / CACHE_INDEX_NAME
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_manifest,
        _corrupt_complete,
        _corrupt_index,
        _truncate_shard,
        _corrupt_shard_header,
        _delete_shard,
        _index_lists_an_extra_tensor,
        _index_total_size_wrong,
    ],
)
def test_each_kind_of_corruption_is_a_miss_and_a_rebuild_repairs_it(built, component, corrupt):
    cache, _ = built
    corrupt(cache)
    assert load_fp8_cache_manifest(cache) is None
    result = load_fp8_weights(component, cache, device="cpu", ignore=["embed"])
    assert not result.hit and result.published
    assert load_fp8_weights(component, cache, device="cpu", ignore=["embed"]).hit


def test_flipped_tensor_bytes_pass_the_cheap_check_but_fail_verify(built):
    cache, _ = built
    shard = _shards(cache)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # last data byte; header and size unchanged
    shard.write_bytes(bytes(data))
    assert load_fp8_cache_manifest(cache) is not None  # lookups do not hash (that would cost the warm start)
    manifest, reason = verify_artifact(cache)
    assert manifest is None and "SHA-256" in reason


def test_quantized_tensor_stored_in_the_wrong_dtype_is_a_miss(built):
    cache, manifest = built
    name = "blocks.0.attn.qkv.weight"
    shard = (
        cache / "transformer" / json.loads((cache / "transformer" / CACHE_INDEX_NAME).read_text())["weight_map"][name]
    )
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].float().bfloat16()
    save_file(tensors, str(shard))
    manifest = _editable(manifest)
    manifest["shards"][shard.name]["size"] = shard.stat().st_size
    _rewrite_manifest(cache, manifest)
    manifest_out, reason = check_artifact(cache)
    assert manifest_out is None and "not a 2-D" in reason


def test_missing_source_file_is_a_miss_not_a_crash(built, component):
    cache, _ = built
    shutil.rmtree(component)
    manifest, reason = check_artifact(cache)
    assert manifest is None and "cannot fingerprint" in reason


def test_bad_inputs_get_clear_errors(component, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_fp8_cache(tmp_path / "nope", tmp_path / "cache")
    with pytest.raises(ValueError, match="no such tensor"):
        build_fp8_cache(component, tmp_path / "cache", quantize=["missing.weight"])
    with pytest.raises(ValueError, match="multiple of 16"):
        build_fp8_cache(component, tmp_path / "cache", quantize=["head.weight"])
    with pytest.raises(ValueError, match="plain directory name"):
        build_fp8_cache(component, tmp_path / "cache", component="../x")
    assert not (tmp_path / "cache").exists()


# --- into a model ---------------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(32, 96)
        self.mlp = torch.nn.Module()
        self.mlp.fc1 = torch.nn.Linear(32, 128, bias=False)
        self.mlp.fc2 = torch.nn.Linear(128, 32, bias=False)
        self.norm = torch.nn.LayerNorm(32, elementwise_affine=True, bias=False)


class _Component(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(32, 20, bias=False)
        self.register_buffer("pos_ids", torch.arange(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block.mlp.fc2(torch.relu(block.mlp.fc1(block.norm(h)))) + block.attn.qkv(h)[..., :32]
        return self.head(h)


def _source_model(directory: Path) -> _Component:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _Component().to(torch.bfloat16)
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    return model


def test_cache_hit_installed_into_a_meta_model_equals_online_quantize_model(tmp_path):
    from fp8_cache import FP8Linear, load_fp8_state_dict, quantize_model

    source_model = _source_model(tmp_path / "src")
    online_report = quantize_model(source_model, ignore=["embed"])
    load_fp8_weights(tmp_path / "src", tmp_path / "cache", device="cpu", quantize=online_report.quantized_weight_names)
    hit = load_fp8_weights(
        tmp_path / "src", tmp_path / "cache", device="cpu", quantize=online_report.quantized_weight_names
    )
    assert hit.hit
    with torch.device("meta"):
        warm_model = _Component().to(torch.bfloat16)
    report = load_fp8_state_dict(warm_model, hit.tensors)
    assert sorted(report.quantized) == sorted(online_report.quantized)
    assert isinstance(warm_model.blocks[1].mlp.fc2, FP8Linear) and type(warm_model.head) is torch.nn.Linear
    assert same_tensors(warm_model.state_dict(), source_model.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(warm_model(ids), source_model(ids))


def test_installing_a_state_dict_with_a_missing_scale_changes_nothing(tmp_path):
    from fp8_cache import load_fp8_state_dict

    _source_model(tmp_path / "src")
    tensors = load_fp8_weights(tmp_path / "src", None, device="cpu", ignore=["embed"]).tensors
    del tensors["blocks.0.mlp.fc1.weight_scale"]
    model = _Component().to(torch.bfloat16)
    with pytest.raises(ValueError, match="no blocks.0.mlp.fc1.weight_scale"):
        load_fp8_state_dict(model, tensors)
    assert type(model.blocks[0].attn.qkv) is torch.nn.Linear
