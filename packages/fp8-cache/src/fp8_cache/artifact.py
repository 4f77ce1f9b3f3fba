"""The on-disk artifact: layout, manifest schema, source fingerprint, and validation (hit or miss).

Layout of one published artifact::

    <cache_dir>/manifest.json                          # schema, contract, sources, shard sizes + SHA-256
    <cache_dir>/COMPLETE                               # "sha256:<hex of manifest.json bytes>\\n", written last
    <cache_dir>/<component>/model.safetensors.index.json
    <cache_dir>/<component>/part-00000.safetensors ...

Tensor names are the component's state-dict names (one namespace): a quantized ``<m>.weight`` is stored as
``float8_e4m3fn`` ``[out, in]`` next to a float32 0-dim ``<m>.weight_scale``; every other tensor is the source
tensor unchanged. ``COMPLETE`` binds to the exact manifest bytes, so a torn or swapped manifest is a miss.

:func:`check_artifact` never raises on a bad artifact: it returns ``(None, reason)``. The cheap checks run on
every lookup (schema, contract, sources, index, shard sizes and headers); :func:`verify_artifact` also hashes
every shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8_cache.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE
from fp8_cache.safetensors_io import SafetensorsFormatError, load_tensors, read_header

logger = logging.getLogger(__name__)

CACHE_SCHEMA_VERSION = 1
CACHE_KIND = "normalized_fp8_runtime"
CACHE_MANIFEST_NAME = "manifest.json"
CACHE_COMPLETE_NAME = "COMPLETE"
CACHE_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_COMPONENT = "transformer"
SCALE_SUFFIX = "_scale"

# Everything a reader must agree with to use the bytes as-is. Changing the quantization math changes this
# dict, which turns every older artifact into a miss.
QUANTIZATION_CONTRACT: dict[str, Any] = {
    "method": "fp8",
    "dtype": "float8_e4m3fn",
    "granularity": "per_tensor",
    "activation_scheme": "dynamic",
    "weight_layout": "out_in",
    "scale_dtype": "float32",
    "scale_rule": f"max(amax/{FP8_MAX:g}, {MIN_SCALE!r})",
}


def shard_name(index: int) -> str:
    return f"part-{index:05d}.safetensors"


def complete_marker(manifest_bytes: bytes) -> str:
    return f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}\n"


def dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def source_fingerprint(files: Iterable[str | os.PathLike[str]]) -> str:
    """SHA-256 over ``(absolute path, size, mtime_ns)`` of each file, in sorted order (stat follows symlinks).

    Content is not hashed: a same-size rewrite that keeps the timestamp is not detected (documented risk).
    Raises ``OSError`` if a file is missing.
    """
    entries = []
    for f in sorted(os.path.abspath(os.fspath(f)) for f in files):
        st = os.stat(f)
        entries.append({"path": f, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    payload = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(payload).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


@dataclass(frozen=True)
class Expectation:
    """What the caller needs the artifact to be; ``None`` fields are not checked."""

    component: str | None = None
    source_files: Collection[str] | None = None
    quantized: Collection[str] | None = None


class _Miss(Exception):
    """Internal: the artifact is not usable, with the reason as the message."""


def check_artifact(
    cache_dir: str | os.PathLike[str] | None, expect: Expectation = Expectation(), *, hash_shards: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "hit")`` for a complete, valid, current artifact; ``(None, reason)`` otherwise."""
    if cache_dir is None:
        return None, "no cache directory configured"
    try:
        return _check(Path(cache_dir), expect, hash_shards), "hit"
    except _Miss as miss:
        return None, str(miss)


def load_fp8_cache_manifest(
    cache_dir: str | os.PathLike[str] | None, expect: Expectation = Expectation()
) -> dict[str, Any] | None:
    """The manifest of a valid artifact, or ``None`` (a miss, reason logged). Never raises on bad artifacts."""
    manifest, reason = check_artifact(cache_dir, expect)
    if manifest is None:
        logger.info("FP8 cache miss at %s: %s", cache_dir, reason)
    return manifest


def _read_json(path: Path, what: str) -> tuple[Any, bytes]:
    try:
        raw = path.read_bytes()
        return json.loads(raw), raw
    except (OSError, ValueError) as exc:
        raise _Miss(f"{what} {path} is unreadable: {exc}") from None


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise _Miss(reason)


def _check(root: Path, expect: Expectation, hash_shards: bool) -> dict[str, Any]:
    _require(root.is_dir(), f"{root} does not exist")
    manifest_path, complete_path = root / CACHE_MANIFEST_NAME, root / CACHE_COMPLETE_NAME
    _require(complete_path.is_file(), f"{CACHE_COMPLETE_NAME} marker is missing (partial or foreign directory)")
    _require(manifest_path.is_file(), f"{CACHE_MANIFEST_NAME} is missing")
    manifest, manifest_bytes = _read_json(manifest_path, "manifest")
    _require(isinstance(manifest, dict), "manifest is not a JSON object")
    try:
        marker = complete_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _Miss(f"{CACHE_COMPLETE_NAME} is unreadable: {exc}") from None
    _require(marker == complete_marker(manifest_bytes), f"{CACHE_COMPLETE_NAME} does not match manifest.json")

    _require(manifest.get("schema_version") == CACHE_SCHEMA_VERSION,
             f"schema_version {manifest.get('schema_version')!r} != {CACHE_SCHEMA_VERSION}")
    _require(manifest.get("cache_kind") == CACHE_KIND, f"cache_kind {manifest.get('cache_kind')!r} != {CACHE_KIND!r}")
    component = manifest.get("component")
    _require(isinstance(component, str) and component != "" and Path(component).name == component
             and component not in (".", ".."), f"component {component!r} is not a plain directory name")
    if expect.component is not None:
        _require(component == expect.component, f"component {component!r} != requested {expect.component!r}")
    _require(manifest.get("quantization") == QUANTIZATION_CONTRACT,
             f"quantization contract {manifest.get('quantization')!r} != {QUANTIZATION_CONTRACT!r}")

    quantized = manifest.get("quantized_tensors")
    _require(isinstance(quantized, list) and all(isinstance(n, str) for n in quantized),
             "quantized_tensors is not a list of names")
    if expect.quantized is not None:
        _require(set(quantized) == set(expect.quantized),
                 "the set of quantized tensors differs from the requested one (ignore patterns changed?)")

    sources = manifest.get("source_files")
    _require(isinstance(sources, list) and sources and all(isinstance(s, str) for s in sources),
             "source_files is not a non-empty list of paths")
    if expect.source_files is not None:
        requested = sorted(os.path.abspath(os.fspath(s)) for s in expect.source_files)
        _require(requested == sorted(sources), "the artifact was built from different source files")
    try:
        fingerprint = source_fingerprint(sources)
    except (OSError, TypeError) as exc:
        raise _Miss(f"cannot fingerprint the source files: {exc}") from None
    _require(manifest.get("source_fingerprint") == fingerprint,
             "stale: source files changed (path, size or mtime) since the artifact was built")

    shards = manifest.get("shards")
    _require(isinstance(shards, dict) and shards, "shards is not a non-empty object")
    component_dir = root / component
    index, _ = _read_json(component_dir / CACHE_INDEX_NAME, "index")
    _require(isinstance(index, dict), "index is not a JSON object")
    weight_map = index.get("weight_map")
    _require(isinstance(weight_map, dict) and weight_map, "index weight_map is not a non-empty object")
    _require(len(weight_map) == manifest.get("tensor_count"),
             f"tensor_count {manifest.get('tensor_count')!r} != {len(weight_map)} indexed tensors")
    for name, filename in weight_map.items():
        _require(isinstance(filename, str) and filename in shards,
                 f"index maps {name!r} to {filename!r}, which is not a shard listed in the manifest")
    by_shard: dict[str, set[str]] = {}
    for name, filename in weight_map.items():
        by_shard.setdefault(filename, set()).add(name)
    _require(set(by_shard) == set(shards), "manifest lists shards that the index does not use")

    total_size = 0
    for filename, record in shards.items():
        _require(isinstance(filename, str) and Path(filename).name == filename and filename.endswith(".safetensors")
                 and not filename.startswith("."), f"shard name {filename!r} escapes the component directory")
        _require(isinstance(record, dict) and isinstance(record.get("size"), int)
                 and isinstance(record.get("sha256"), str), f"shard record for {filename!r} is malformed")
        path = component_dir / filename
        _require(path.is_file() and not path.is_symlink(), f"shard {filename} is missing")
        _require(path.stat().st_size == record["size"],
                 f"shard {filename} is {path.stat().st_size} bytes, manifest says {record['size']}")
        try:
            entries = {e.name: e for e in read_header(path)}
        except (OSError, SafetensorsFormatError) as exc:
            raise _Miss(f"shard {filename} is corrupt: {exc}") from None
        _require(set(entries) == by_shard[filename], f"shard {filename} holds different tensors than the index says")
        total_size += sum(e.nbytes for e in entries.values())
        for name, entry in entries.items():
            if name in quantized:
                _require(entry.dtype == FP8_DTYPE and len(entry.shape) == 2,
                         f"quantized tensor {name!r} is not a 2-D {FP8_DTYPE}")
        if hash_shards:
            _require(file_sha256(path) == record["sha256"], f"shard {filename} fails its SHA-256 check")
    metadata = index.get("metadata")
    _require(manifest.get("total_size") == total_size
             and isinstance(metadata, dict) and metadata.get("total_size") == total_size,
             f"total_size in the manifest/index disagrees with the shards' {total_size} tensor bytes")
    for name in quantized:
        _require(name in weight_map and scale_name(name) in weight_map,
                 f"quantized tensor {name!r} or its scale is not in the index")
    return manifest


def verify_artifact(cache_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str]:
    """Like :func:`check_artifact` plus the SHA-256 of every shard and finite, positive scales."""
    manifest, reason = check_artifact(cache_dir, hash_shards=True)
    if manifest is None:
        return None, reason
    component_dir = Path(cache_dir) / manifest["component"]
    tensors = load_tensors(sorted(component_dir / s for s in manifest["shards"]), "cpu")
    for name in manifest["quantized_tensors"]:
        scale = tensors[scale_name(name)]
        if scale.dtype != torch.float32 or scale.numel() != 1 or not bool(torch.isfinite(scale).all()) or scale.item() <= 0:
            return None, f"scale of {name!r} is not a finite positive float32 scalar"
    return manifest, "ok"
