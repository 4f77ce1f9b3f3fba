"""Fast reads of safetensors files into device memory.

Names, dtypes and shapes come from safetensors' own header reader (:func:`read_tensor_specs`). Moving the bytes
needs each tensor's file offsets, which safetensors does not expose, so :func:`read_header` parses the header
(8-byte little-endian length + JSON) itself; then tensor bytes move without safetensors' per-tensor host copies:

- to CPU, tensors are zero-copy views of a private (copy-on-write) mmap of the file;
- to CUDA, worker threads ``pread`` contiguous file ranges into pinned staging buffers and issue one
  asynchronous H2D copy per tensor piece on their own stream; the host waits only when a staging buffer is
  reused and once at the end. Destination tensors are separate device allocations. The staging buffers live
  for one load: they are freed, and their pages unpinned, before :func:`load_tensors` returns.

Nothing here quantizes or validates cache semantics; it only guarantees that every returned tensor has the
dtype, shape and bytes its header describes, and raises :class:`SafetensorsFormatError` otherwise.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import SafetensorError, safe_open

# A safetensors header's dtype name -> the torch dtype it is read as (safetensors' own table is private).
SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)
# A header larger than this is not a header (safetensors itself caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """A file is not a well-formed safetensors file (bad header, offsets out of range, unknown dtype)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorEntry(TensorSpec):
    """A tensor and where its bytes are: ``begin``/``end`` are absolute byte offsets in the file
    (``end - begin == nbytes``, checked when the header is parsed)."""

    begin: int
    end: int


def read_tensor_specs(path: str | os.PathLike[str]) -> list[TensorSpec]:
    """Name, dtype and shape of every tensor of ``path``, through safetensors' own header reader."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            slices = [(name, f.get_slice(name)) for name in f.keys()]
            raw = [(name, sl.get_dtype(), tuple(sl.get_shape())) for name, sl in slices]
    except (SafetensorError, OSError) as exc:
        raise SafetensorsFormatError(f"{path}: {exc}") from None
    specs = []
    for name, dtype_name, shape in raw:
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
        specs.append(TensorSpec(name, dtype, shape))
    return specs


def read_header(path: str | os.PathLike[str]) -> list[TensorEntry]:
    """Parse and check the header of ``path``; entries are returned in file-offset order."""
    path = Path(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) != 8:
            raise SafetensorsFormatError(f"{path}: shorter than the 8-byte header length prefix")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise SafetensorsFormatError(f"{path}: header length {header_len} exceeds the file size {file_size}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsFormatError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_parse_entry(path, name, info, data_start, file_size))
    entries.sort(key=lambda e: e.begin)
    for previous, current in pairwise(entries):
        if current.begin < previous.end:
            raise SafetensorsFormatError(f"{path}: tensors {previous.name!r} and {current.name!r} overlap")
    return entries


def _parse_entry(path: Path, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise SafetensorsFormatError(f"{path}: entry {name!r} is not an object")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype is None:
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    numel = 1
    for dim in shape:
        numel *= dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not (data_start <= begin <= end <= file_size) or end - begin != numel * itemsize:
        raise SafetensorsFormatError(
            f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit the file ({file_size} bytes) "
            f"or its shape {shape} x {itemsize} bytes"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def load_tensors(files: Sequence[str | os.PathLike[str]], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` placed on ``device``; names must be unique across files."""
    device = torch.device(device)
    parsed = {str(f): read_header(f) for f in files}
    seen: dict[str, str] = {}
    for path, entries in parsed.items():
        for entry in entries:
            if entry.name in seen:
                raise SafetensorsFormatError(f"tensor {entry.name!r} appears in both {seen[entry.name]} and {path}")
            seen[entry.name] = path
    if device.type == "cpu":
        return _load_mmap_views(parsed)
    if device.type == "cuda":
        with _StagedCudaReader(device) as reader:
            return reader.load(parsed)
    # Other accelerators: pageable copies through the CPU mmap views.
    return {name: t.to(device) for name, t in _load_mmap_views(parsed).items()}


def _load_mmap_views(parsed: dict[str, list[TensorEntry]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path, entries in parsed.items():
        size = os.stat(path).st_size
        if size == 0:
            continue
        storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        for entry in entries:
            view = raw[entry.begin : entry.end]
            itemsize = torch.empty((), dtype=entry.dtype).element_size()
            if entry.begin % itemsize:  # unaligned for this dtype: a view is impossible, copy instead
                view = view.clone()
            out[entry.name] = view.view(entry.dtype).reshape(entry.shape)
    return out


@dataclass(frozen=True)
class _Piece:
    """One staging-buffer load: bytes ``[file_lo, file_hi)`` of ``path`` and where each part of them goes."""

    path: str
    file_lo: int
    file_hi: int
    pieces: tuple[tuple[str, int, int, int], ...]  # (tensor name, dst offset, chunk offset, length)


class _StagedCudaReader:
    """Pinned staging buffers and copy streams for one load onto one CUDA device (a context manager).

    Each worker owns ``buffers_per_worker`` pinned buffers of up to ``chunk_bytes`` (no larger than its largest
    chunk, so a small load pins little). A buffer is refilled only after the event recorded behind its previous
    H2D copies has completed, so host reads overlap device copies. Leaving the context frees the buffers and
    returns their pinned pages to the system: a process that loaded its weights keeps no staging memory pinned.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        workers: int = min(4, os.cpu_count() or 1),
        chunk_bytes: int = 8 << 20,
        buffers_per_worker: int = 2,
    ) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.workers = workers
        self.buffers_per_worker = buffers_per_worker
        self._buffers: list[list[torch.Tensor]] = []
        self._streams: list[torch.cuda.Stream] = []

    def __enter__(self) -> _StagedCudaReader:
        self._streams = [torch.cuda.Stream(self.device) for _ in range(self.workers)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Every copy out of the buffers has completed (each worker synchronises its stream before returning).
        self._buffers, self._streams = [], []
        _release_cached_pinned_memory()

    def load(self, parsed: dict[str, list[TensorEntry]]) -> dict[str, torch.Tensor]:
        destinations = {
            e.name: torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
            for entries in parsed.values()
            for e in entries
        }
        # The destinations were allocated on the current stream; the copy streams must not start before that.
        current = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            stream.wait_stream(current)
        chunks = list(self._plan_chunks(parsed))
        # Contiguous runs of chunks per worker keep each worker's reads sequential within a file.
        per_worker = max(1, -(-len(chunks) // self.workers))
        runs = [chunks[i : i + per_worker] for i in range(0, len(chunks), per_worker)]
        self._buffers = [
            [
                torch.empty(max(p.file_hi - p.file_lo for p in run), dtype=torch.uint8, pin_memory=True)
                for _ in range(self.buffers_per_worker)
            ]
            for run in runs
        ]
        with ThreadPoolExecutor(max_workers=len(runs) or 1) as pool:
            list(pool.map(self._copy_run, range(len(runs)), runs, [destinations] * len(runs)))
        for stream in self._streams[: len(runs)]:
            current.wait_stream(stream)
        return {
            e.name: destinations[e.name].view(e.dtype).reshape(e.shape) for entries in parsed.values() for e in entries
        }

    def _plan_chunks(self, parsed: dict[str, list[TensorEntry]]) -> Iterable[_Piece]:
        for path, entries in parsed.items():
            if not entries:
                continue
            lo, hi = entries[0].begin, max(e.end for e in entries)
            for chunk_lo in range(lo, hi, self.chunk_bytes):
                chunk_hi = min(chunk_lo + self.chunk_bytes, hi)
                pieces = []
                for e in entries:
                    a, b = max(e.begin, chunk_lo), min(e.end, chunk_hi)
                    if a < b:
                        pieces.append((e.name, a - e.begin, a - chunk_lo, b - a))
                if pieces:
                    yield _Piece(path, chunk_lo, chunk_hi, tuple(pieces))

    def _copy_run(self, worker: int, run: list[_Piece], destinations: dict[str, torch.Tensor]) -> None:
        stream = self._streams[worker]
        buffers = self._buffers[worker]
        events: list[torch.cuda.Event | None] = [None] * len(buffers)
        fds: dict[str, int] = {}
        try:
            with torch.cuda.stream(stream):
                for i, piece in enumerate(run):
                    slot = i % len(buffers)
                    if events[slot] is not None:
                        events[slot].synchronize()  # the previous copies out of this buffer are done
                    staging = buffers[slot]
                    fd = fds.get(piece.path)
                    if fd is None:
                        fd = fds[piece.path] = os.open(piece.path, os.O_RDONLY)
                    _pread_exact(fd, host_bytes(staging, piece.file_hi - piece.file_lo), piece.file_lo, piece.path)
                    for name, dst_offset, src_offset, length in piece.pieces:
                        destinations[name][dst_offset : dst_offset + length].copy_(
                            staging[src_offset : src_offset + length], non_blocking=True
                        )
                    event = torch.cuda.Event()
                    event.record(stream)
                    events[slot] = event
        finally:
            # Also on error: no copy may still be reading a staging buffer or writing a freed destination.
            stream.synchronize()
            for fd in fds.values():
                os.close(fd)


def _release_cached_pinned_memory() -> None:
    """Give freed pinned pages back to the system; torch's host caching allocator would keep them otherwise."""
    release = getattr(torch.accelerator, "empty_host_cache", None)
    if release is None:  # a torch from before this was public: the same operation under its old name
        release = torch._C._host_emptyCache
    release()


def host_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """A writable view of the first ``nbytes`` of a contiguous CPU tensor's memory (no numpy needed)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes > tensor.numel() * tensor.element_size():
        raise ValueError("host_bytes needs a contiguous CPU tensor at least nbytes long")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SafetensorsFormatError(f"{path}: file ended at byte {offset + done}, expected more data")
        done += n
