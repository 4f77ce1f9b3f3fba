"""Building and atomically publishing an FP8 cache artifact.

Publication protocol (crash-safe: a reader sees no artifact or a complete one, never a partial one):

1. An advisory ``flock`` on ``<parent>/.<name>.lock`` elects one writer per node (optional; correctness does
   not depend on it). Whoever gets the lock re-checks the cache first and adopts a valid artifact.
2. Everything is written under ``<parent>/.<name>.tmp-<pid>-<uuid>/``; every file and directory is fsynced;
   ``COMPLETE`` (bound to the manifest's SHA-256) is written last.
3. ``rename(tmp, cache_dir)`` publishes in one step. If ``cache_dir`` already holds a non-empty directory
   (Linux raises ``ENOTEMPTY``), the writer re-validates: a valid artifact (a concurrent publisher) is adopted
   quietly; a stale or corrupt one of ours is renamed aside atomically and replaced; anything else is left
   alone with an error.
4. Temporary and set-aside directories whose owning process is dead are removed by the next writer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import logging
import os
import shutil
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from fp8_cache import __version__
from fp8_cache.artifact import (
    CACHE_COMPLETE_NAME,
    CACHE_INDEX_NAME,
    CACHE_KIND,
    CACHE_MANIFEST_NAME,
    CACHE_SCHEMA_VERSION,
    DEFAULT_COMPONENT,
    QUANTIZATION_CONTRACT,
    CacheManifest,
    Expectation,
    IndexMetadata,
    ShardIndex,
    ShardRecord,
    check_artifact,
    complete_marker,
    dump_json,
    file_sha256,
    scale_name,
    shard_name,
    source_fingerprint,
)
from fp8_cache.linear import ineligible_weight_reason
from fp8_cache.quant import per_tensor_scale, quantize_with_scale, require_finite_scales
from fp8_cache.safetensors_io import TensorSpec, load_tensors, read_tensor_specs

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 1 << 30

SourceSpec = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class BuildResult:
    """``action``: ``already_valid`` (nothing written), ``published`` (this call wrote it) or ``adopted``
    (another process published a valid artifact first)."""

    manifest: CacheManifest
    action: Literal["already_valid", "published", "adopted"]
    cache_dir: Path


def resolve_source_files(sources: SourceSpec) -> list[str]:
    """Absolute, sorted ``.safetensors`` paths: a directory means every ``*.safetensors`` directly inside it."""
    items = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    files: set[str] = set()
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"source directory {path} holds no *.safetensors files")
            files.update(os.path.abspath(p) for p in found)
        elif path.is_file():
            files.add(os.path.abspath(path))
        else:
            raise FileNotFoundError(f"source {path} does not exist; pass a safetensors file or a directory of them")
    if not files:
        raise ValueError("no source files given")
    return sorted(files)


def read_source_specs(files: Sequence[str]) -> dict[str, TensorSpec]:
    """Every source tensor's name, dtype and shape (safetensors' own header reader); a name in two files is an
    error."""
    entries: dict[str, TensorSpec] = {}
    where: dict[str, str] = {}
    for f in files:
        for spec in read_tensor_specs(f):
            if spec.name in entries:
                raise ValueError(f"tensor {spec.name!r} appears in both {where[spec.name]} and {f}")
            entries[spec.name], where[spec.name] = spec, f
    return entries


def select_quantized(
    entries: Mapping[str, TensorSpec], *, quantize: Collection[str] | None = None, ignore: Sequence[str] = ()
) -> list[str]:
    """Names of the tensors to store as FP8.

    With ``quantize`` (e.g. ``QuantizationReport.quantized_weight_names``) exactly those, each checked. Without
    it, every ``*.weight`` that :func:`fp8_cache.linear.ineligible_weight_reason` accepts and whose module name
    (the name without ``.weight``) matches no ``ignore`` pattern: the rule ``quantize_model`` applies to
    ``nn.Linear`` layers. Tensors that are not linear weights (e.g. embedding tables) must then be excluded via
    ``ignore``.
    """
    if isinstance(ignore, str):
        raise TypeError("ignore must be a sequence of fnmatch patterns, not a single string; wrap it in a list")
    if quantize is not None:
        if isinstance(quantize, str):
            raise TypeError("quantize must be a collection of tensor names, not a single string")
        chosen = sorted(set(quantize))
        for name in chosen:
            if name not in entries:
                raise ValueError(f"cannot quantize {name!r}: no such tensor in the source files")
            if (reason := ineligible_weight_reason(entries[name].shape, entries[name].dtype)) is not None:
                raise ValueError(f"cannot quantize {name!r}: {reason}")
            if scale_name(name) in entries:
                raise ValueError(f"cannot quantize {name!r}: the source already has a tensor {scale_name(name)!r}")
        return chosen
    chosen = []
    for name, entry in sorted(entries.items()):
        module = name.removesuffix(".weight")
        if (
            name.endswith(".weight")
            and ineligible_weight_reason(entry.shape, entry.dtype) is None
            and scale_name(name) not in entries
            and not any(fnmatch.fnmatchcase(module, p) for p in ignore)
        ):
            chosen.append(name)
    return chosen


def quantize_state_dict(tensors: Mapping[str, torch.Tensor], quantized: Collection[str]) -> dict[str, torch.Tensor]:
    """The runtime state dict: each name in ``quantized`` becomes FP8 plus ``<name>_scale``, on its device.

    Non-finite weights raise ``NonFiniteWeightError`` after one host synchronisation for the whole dict.
    """
    scales = {name: per_tensor_scale(tensors[name]) for name in quantized}
    require_finite_scales(scales)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in scales:
            out[name] = quantize_with_scale(tensor, scales[name])
            out[scale_name(name)] = scales[name]
        else:
            out[name] = tensor
    return out


def build_fp8_cache(
    sources: SourceSpec,
    cache_dir: str | os.PathLike[str],
    *,
    component: str = DEFAULT_COMPONENT,
    quantize: Collection[str] | None = None,
    ignore: Sequence[str] = (),
    device: torch.device | str = "cpu",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    elect_writer: bool = True,
) -> BuildResult:
    """Quantize ``sources`` (one component's safetensors) on ``device`` and publish the artifact atomically.

    Idempotent: a valid, current artifact is returned untouched. One source file is resident at a time.
    """
    files = resolve_source_files(sources)
    quantized = select_quantized(read_source_specs(files), quantize=quantize, ignore=ignore)
    expect = Expectation(component=component, source_files=files, quantized=quantized)
    manifest, _ = check_artifact(cache_dir, expect)
    if manifest is not None:
        return BuildResult(manifest, "already_valid", Path(cache_dir))

    def runtime_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            loaded = load_tensors([f], device)
            yield from quantize_state_dict(loaded, [n for n in quantized if n in loaded]).items()
            del loaded

    return publish_artifact(
        runtime_tensors(),
        cache_dir,
        component=component,
        quantized=quantized,
        source_files=files,
        max_shard_bytes=max_shard_bytes,
        elect_writer=elect_writer,
    )


def publish_artifact(
    tensors: Iterable[tuple[str, torch.Tensor]],
    cache_dir: str | os.PathLike[str],
    *,
    component: str,
    quantized: Collection[str],
    source_files: Sequence[str],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    elect_writer: bool = True,
) -> BuildResult:
    """Write already-final runtime tensors (FP8 weights + scales + the rest) as an artifact and publish it.

    ``tensors`` is consumed only if this process ends up writing (not when it adopts another's artifact).
    """
    if not component or Path(component).name != component or component in (".", ".."):
        raise ValueError(f"component {component!r} must be a plain directory name such as 'transformer'")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    root = Path(os.path.abspath(cache_dir))
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"cache path {root} exists and is not a directory; remove it or pick another path")
    files = sorted(os.path.abspath(f) for f in source_files)
    expect = Expectation(component=component, source_files=files, quantized=quantized)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(root, enabled=elect_writer):
        manifest, _ = check_artifact(root, expect)
        if manifest is not None:
            logger.info("FP8 cache at %s was published by another process; adopting it", root)
            return BuildResult(manifest, "adopted", root)
        _sweep_abandoned(root)
        tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            manifest = _write_tree(
                tmp,
                tensors,
                component=component,
                quantized=sorted(quantized),
                source_files=files,
                max_shard_bytes=max_shard_bytes,
            )
            action, manifest = _move_into_place(tmp, root, manifest, expect)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if action == "published":
        logger.info("published FP8 cache at %s (%d tensors)", root, manifest.tensor_count)
    return BuildResult(manifest, action, root)


@contextlib.contextmanager
def _writer_lock(root: Path, *, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    # The lock file is never deleted: unlinking a lock file others may hold open breaks mutual exclusion.
    fd = os.open(root.parent / f".{root.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock; the kernel also releases it if this process dies


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_abandoned(root: Path) -> None:
    """Remove ``.<name>.tmp-<pid>-*`` / ``.<name>.stale-<pid>-*`` left by dead processes on this node."""
    for kind in ("tmp", "stale"):
        for path in root.parent.glob(f".{root.name}.{kind}-*"):
            pid_text = path.name.removeprefix(f".{root.name}.{kind}-").split("-", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text)):
                logger.info("removing abandoned FP8 cache directory %s", path)
                shutil.rmtree(path, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_tree(
    tmp: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    component: str,
    quantized: list[str],
    source_files: list[str],
    max_shard_bytes: int,
) -> CacheManifest:
    component_dir = tmp / component
    component_dir.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shards: dict[str, ShardRecord] = {}
    batch: dict[str, torch.Tensor] = {}
    batch_bytes = 0
    total_size = 0

    def flush() -> None:
        name = shard_name(len(shards))
        path = component_dir / name
        save_file(batch, str(path), metadata={"format": "pt"})
        _fsync_path(path)
        shards[name] = ShardRecord(size=path.stat().st_size, sha256=file_sha256(path))
        weight_map.update(dict.fromkeys(batch, name))
        batch.clear()

    for name, tensor in tensors:
        if name in weight_map or name in batch:
            raise ValueError(f"FP8 cache got tensor {name!r} twice")
        cpu = tensor.detach().to("cpu").contiguous()
        nbytes = cpu.numel() * cpu.element_size()
        if batch and batch_bytes + nbytes > max_shard_bytes:
            flush()
            batch_bytes = 0
        batch[name] = cpu
        batch_bytes += nbytes
        total_size += nbytes
    if batch:
        flush()
    if not weight_map:
        raise ValueError("FP8 cache got no tensors to write")
    for name in quantized:
        if name not in weight_map or scale_name(name) not in weight_map:
            raise ValueError(f"quantized tensor {name!r} or its scale {scale_name(name)!r} was not written")

    index = ShardIndex(metadata=IndexMetadata(total_size=total_size), weight_map=dict(sorted(weight_map.items())))
    _write_file(component_dir / CACHE_INDEX_NAME, dump_json(index))
    _fsync_path(component_dir)
    manifest = CacheManifest(
        schema_version=CACHE_SCHEMA_VERSION,
        cache_kind=CACHE_KIND,
        component=component,
        quantization=QUANTIZATION_CONTRACT,
        quantized_tensors=tuple(quantized),
        tensor_count=len(weight_map),
        total_size=total_size,
        source_files=tuple(source_files),
        source_fingerprint=source_fingerprint(source_files),
        shards=shards,
        created_by={"fp8_cache": __version__, "torch": str(torch.__version__)},
    )
    manifest_bytes = dump_json(manifest)
    _write_file(tmp / CACHE_MANIFEST_NAME, manifest_bytes)
    _write_file(tmp / CACHE_COMPLETE_NAME, complete_marker(manifest_bytes).encode())
    _fsync_path(tmp)
    return manifest


def _is_replaceable_artifact(root: Path) -> bool:
    """True if ``root`` only holds files this library writes (so replacing it cannot destroy user data)."""
    try:
        children = list(root.iterdir())
    except OSError:
        return False
    if not any(c.name in (CACHE_MANIFEST_NAME, CACHE_COMPLETE_NAME) for c in children):
        return not children
    for child in children:
        if child.name in (CACHE_MANIFEST_NAME, CACHE_COMPLETE_NAME) and child.is_file():
            continue
        if (
            child.is_dir()
            and not child.is_symlink()
            and all(
                f.is_file() and (f.name == CACHE_INDEX_NAME or f.name.endswith(".safetensors")) for f in child.iterdir()
            )
        ):
            continue
        return False
    return True


def _move_into_place(
    tmp: Path, root: Path, manifest: CacheManifest, expect: Expectation
) -> tuple[Literal["published", "adopted"], CacheManifest]:
    try:
        os.rename(tmp, root)  # atomic; also succeeds onto an empty directory
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        existing, reason = check_artifact(root, expect)
        if existing is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("FP8 cache at %s was published concurrently; adopting it", root)
            return "adopted", existing
        if not _is_replaceable_artifact(root):
            raise FileExistsError(
                f"{root} is not empty and is not an FP8 cache artifact; refusing to replace it. "
                "Remove it or choose another cache directory."
            ) from None
        aside = root.parent / f".{root.name}.stale-{os.getpid()}-{uuid.uuid4().hex}"
        logger.info("replacing the FP8 cache at %s (%s)", root, reason)
        with contextlib.suppress(FileNotFoundError):  # another writer may have moved it aside already
            os.rename(root, aside)
        try:
            os.rename(tmp, root)
        except OSError as again:
            if again.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            existing, reason = check_artifact(root, expect)
            if existing is None:
                raise RuntimeError(
                    f"another process keeps publishing an unusable FP8 cache at {root}: {reason}"
                ) from None
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(aside, ignore_errors=True)
            return "adopted", existing
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_path(root.parent)
    return "published", manifest
