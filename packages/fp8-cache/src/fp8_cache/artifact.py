"""The on-disk artifact: layout, manifest schema, source fingerprint, and validation (hit or miss).

Layout of one published artifact::

    <cache_dir>/manifest.json                          # schema, contract, sources, shard sizes + SHA-256
    <cache_dir>/COMPLETE                               # "sha256:<hex of manifest.json bytes>\\n", written last
    <cache_dir>/<component>/model.safetensors.index.json
    <cache_dir>/<component>/part-00000.safetensors ...

Tensor names are the component's state-dict names (one namespace): a quantized ``<m>.weight`` is stored as
``float8_e4m3fn`` ``[out, in]`` next to a float32 0-dim ``<m>.weight_scale``; every other tensor is the source
tensor unchanged. ``COMPLETE`` binds to the exact manifest bytes, so a torn or swapped manifest is a miss.

:class:`CacheManifest` and :class:`ShardIndex` are typed ``msgspec`` structs: decoding a file is validating its
schema (field types, the plain-name and shard-name rules, schema version and kind). :func:`check_artifact` adds
what no type can say (the ``COMPLETE`` binding, the contract, the sources' fingerprint, agreement between
manifest, index and shard headers) and never raises on a bad artifact: it returns ``(None, reason)``. The cheap
checks run on every lookup; :func:`verify_artifact` also hashes every shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import torch
from msgspec import Meta, Struct

from fp8_cache.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE
from fp8_cache.safetensors_io import SafetensorsFormatError, load_tensors, read_tensor_specs

logger = logging.getLogger(__name__)

SchemaVersion = Literal[1]
CacheKind = Literal["normalized_fp8_runtime"]
CACHE_SCHEMA_VERSION: int = get_args(SchemaVersion)[0]
CACHE_KIND: str = get_args(CacheKind)[0]
CACHE_MANIFEST_NAME = "manifest.json"
CACHE_COMPLETE_NAME = "COMPLETE"
CACHE_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_COMPONENT = "transformer"
SCALE_SUFFIX = "_scale"

# A directory entry: no "/", not "." or "..".
PlainName = Annotated[str, Meta(pattern=r"^(?!\.\.?$)[^/\x00]+$")]
# A shard file directly inside the component directory, never hidden.
ShardFileName = Annotated[str, Meta(pattern=r"^[^/.\x00][^/\x00]*\.safetensors$")]


class QuantizationContract(Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a reader must agree with to use the stored bytes as-is."""

    method: str
    dtype: str
    granularity: str
    activation_scheme: str
    weight_layout: str
    scale_dtype: str
    scale_rule: str


# Changing the quantization math changes this contract, which turns every older artifact into a miss.
QUANTIZATION_CONTRACT = QuantizationContract(
    method="fp8",
    dtype="float8_e4m3fn",
    granularity="per_tensor",
    activation_scheme="dynamic",
    weight_layout="out_in",
    scale_dtype="float32",
    scale_rule=f"max(amax/{FP8_MAX:g}, {MIN_SCALE!r})",
)


class ShardRecord(Struct, frozen=True, forbid_unknown_fields=True):
    size: Annotated[int, Meta(ge=0)]
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class CacheManifest(Struct, frozen=True, forbid_unknown_fields=True):
    """``manifest.json``: what was quantized, from which sources, and the shards that hold it."""

    schema_version: SchemaVersion
    cache_kind: CacheKind
    component: PlainName
    quantization: QuantizationContract
    quantized_tensors: tuple[str, ...]
    tensor_count: Annotated[int, Meta(ge=1)]
    total_size: Annotated[int, Meta(ge=0)]
    source_files: Annotated[tuple[str, ...], Meta(min_length=1)]
    source_fingerprint: str
    shards: Annotated[dict[ShardFileName, ShardRecord], Meta(min_length=1)]
    created_by: dict[str, str]


class IndexMetadata(Struct, frozen=True):
    total_size: Annotated[int, Meta(ge=0)]


class ShardIndex(Struct, frozen=True, forbid_unknown_fields=True):
    """``<component>/model.safetensors.index.json``: which shard holds each tensor (Hugging Face layout)."""

    metadata: IndexMetadata
    weight_map: Annotated[dict[str, ShardFileName], Meta(min_length=1)]


def shard_name(index: int) -> str:
    return f"part-{index:05d}.safetensors"


def complete_marker(manifest_bytes: bytes) -> str:
    return f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}\n"


def dump_json(obj: Any) -> bytes:
    """Indented JSON with sorted keys (structs, dicts, lists), newline-terminated."""
    return msgspec.json.format(msgspec.json.encode(obj, order="sorted"), indent=2) + b"\n"


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
) -> tuple[CacheManifest | None, str]:
    """``(manifest, "hit")`` for a complete, valid, current artifact; ``(None, reason)`` otherwise."""
    if cache_dir is None:
        return None, "no cache directory configured"
    try:
        return _check(Path(cache_dir), expect, hash_shards), "hit"
    except _Miss as miss:
        return None, str(miss)


def load_fp8_cache_manifest(
    cache_dir: str | os.PathLike[str] | None, expect: Expectation = Expectation()
) -> CacheManifest | None:
    """The manifest of a valid artifact, or ``None`` (a miss, reason logged). Never raises on bad artifacts."""
    manifest, reason = check_artifact(cache_dir, expect)
    if manifest is None:
        logger.info("FP8 cache miss at %s: %s", cache_dir, reason)
    return manifest


def _decode(path: Path, what: str, kind: type[Struct]) -> tuple[Any, bytes]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _Miss(f"{what} {path} is unreadable: {exc}") from None
    try:
        return msgspec.json.decode(raw, type=kind), raw
    except msgspec.DecodeError as exc:  # ValidationError included
        raise _Miss(f"{what} {path} does not match its schema: {exc}") from None


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise _Miss(reason)


def _check(root: Path, expect: Expectation, hash_shards: bool) -> CacheManifest:
    _require(root.is_dir(), f"{root} does not exist")
    manifest_path, complete_path = root / CACHE_MANIFEST_NAME, root / CACHE_COMPLETE_NAME
    _require(complete_path.is_file(), f"{CACHE_COMPLETE_NAME} marker is missing (partial or foreign directory)")
    _require(manifest_path.is_file(), f"{CACHE_MANIFEST_NAME} is missing")
    try:
        marker = complete_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _Miss(f"{CACHE_COMPLETE_NAME} is unreadable: {exc}") from None
    manifest, manifest_bytes = _decode(manifest_path, "manifest", CacheManifest)
    _require(marker == complete_marker(manifest_bytes), f"{CACHE_COMPLETE_NAME} does not match manifest.json")

    if expect.component is not None:
        _require(
            manifest.component == expect.component,
            f"component {manifest.component!r} != requested {expect.component!r}",
        )
    _require(
        manifest.quantization == QUANTIZATION_CONTRACT,
        f"quantization contract {manifest.quantization!r} != {QUANTIZATION_CONTRACT!r}",
    )
    if expect.quantized is not None:
        _require(
            set(manifest.quantized_tensors) == set(expect.quantized),
            "the set of quantized tensors differs from the requested one (ignore patterns changed?)",
        )
    if expect.source_files is not None:
        requested = sorted(os.path.abspath(os.fspath(s)) for s in expect.source_files)
        _require(requested == sorted(manifest.source_files), "the artifact was built from different source files")
    try:
        fingerprint = source_fingerprint(manifest.source_files)
    except OSError as exc:
        raise _Miss(f"cannot fingerprint the source files: {exc}") from None
    _require(
        manifest.source_fingerprint == fingerprint,
        "stale: source files changed (path, size or mtime) since the artifact was built",
    )

    component_dir = root / manifest.component
    index, _ = _decode(component_dir / CACHE_INDEX_NAME, "index", ShardIndex)
    weight_map = index.weight_map
    _require(
        len(weight_map) == manifest.tensor_count,
        f"tensor_count {manifest.tensor_count} != {len(weight_map)} indexed tensors",
    )
    by_shard: dict[str, set[str]] = {}
    for name, filename in weight_map.items():
        by_shard.setdefault(filename, set()).add(name)
    _require(set(by_shard) == set(manifest.shards), "the index and the manifest list different shards")

    quantized = set(manifest.quantized_tensors)
    total_size = 0
    for filename, record in manifest.shards.items():
        path = component_dir / filename
        _require(path.is_file() and not path.is_symlink(), f"shard {filename} is missing")
        _require(
            path.stat().st_size == record.size,
            f"shard {filename} is {path.stat().st_size} bytes, manifest says {record.size}",
        )
        try:
            specs = {spec.name: spec for spec in read_tensor_specs(path)}
        except SafetensorsFormatError as exc:
            raise _Miss(f"shard {filename} is corrupt: {exc}") from None
        _require(set(specs) == by_shard[filename], f"shard {filename} holds different tensors than the index says")
        total_size += sum(spec.nbytes for spec in specs.values())
        for name in quantized.intersection(specs):
            _require(
                specs[name].dtype == FP8_DTYPE and len(specs[name].shape) == 2,
                f"quantized tensor {name!r} is not a 2-D {FP8_DTYPE}",
            )
        if hash_shards:
            _require(file_sha256(path) == record.sha256, f"shard {filename} fails its SHA-256 check")
    _require(
        manifest.total_size == total_size == index.metadata.total_size,
        f"total_size in the manifest/index disagrees with the shards' {total_size} tensor bytes",
    )
    for name in quantized:
        _require(
            name in weight_map and scale_name(name) in weight_map,
            f"quantized tensor {name!r} or its scale is not in the index",
        )
    return manifest


def verify_artifact(cache_dir: str | os.PathLike[str]) -> tuple[CacheManifest | None, str]:
    """Like :func:`check_artifact` plus the SHA-256 of every shard and finite, positive scales."""
    manifest, reason = check_artifact(cache_dir, hash_shards=True)
    if manifest is None:
        return None, reason
    component_dir = Path(cache_dir) / manifest.component
    tensors = load_tensors(sorted(component_dir / s for s in manifest.shards), "cpu")
    for name in manifest.quantized_tensors:
        scale = tensors[scale_name(name)]
        if (
            scale.dtype != torch.float32
            or scale.numel() != 1
            or not bool(torch.isfinite(scale).all())
            or scale.item() <= 0
        ):
            return None, f"scale of {name!r} is not a finite positive float32 scalar"
    return manifest, "ok"
