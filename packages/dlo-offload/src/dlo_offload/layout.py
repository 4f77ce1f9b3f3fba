"""Byte layout of one block: every parameter and buffer packed into one flat buffer.

A block's tensors are grouped by dtype (first-seen order, then declaration order:
parameters before buffers) and laid out back to back in one ``uint8`` buffer, each
starting at a multiple of `ALIGNMENT_BYTES`. Each tensor occupies its *physical*
span, ``1 + sum((size_i - 1) * stride_i)`` elements, written in storage order, so
a transposed or otherwise strided tensor is rebuilt with its original shape and
stride by a zero-copy ``as_strided`` view. Because packing moves bytes, every
dtype (FP8, bool, integers) round-trips bit-exactly, and one H2D copy or one
collective moves a whole block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

ALIGNMENT_BYTES = 256

TensorKind = Literal["parameter", "buffer"]


def storage_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of elements between a tensor's first and last addressed element, inclusive."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _align(nbytes: int) -> int:
    return _cdiv(nbytes, ALIGNMENT_BYTES) * ALIGNMENT_BYTES


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a block lives inside the block's packed bytes."""

    name: str
    kind: TensorKind
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int
    span_numel: int

    @property
    def nbytes(self) -> int:
        return self.span_numel * torch.empty((), dtype=self.dtype).element_size()

    def view_in(self, packed: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of `packed`, the block's bytes (any device)."""
        raw = packed[self.byte_offset : self.byte_offset + self.nbytes]
        return raw.view(self.dtype).as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class BlockLayout:
    """The packed layout of one block.

    Invariants: entries do not overlap; every ``byte_offset`` is a multiple of
    `ALIGNMENT_BYTES`; ``nbytes`` covers every entry and is aligned.
    """

    entries: tuple[TensorEntry, ...]
    nbytes: int

    def shard_nbytes(self, world_size: int) -> int:
        """Bytes each of `world_size` ranks holds: equal, aligned, zero-padded shards."""
        return _align(_cdiv(self.nbytes, world_size)) if self.nbytes else 0

    def digest(self) -> bytes:
        """SHA-256 of the layout, equal on two ranks exactly when their layouts are."""
        text = repr([(e.name, e.kind, str(e.dtype), e.shape, e.stride, e.byte_offset) for e in self.entries])
        return hashlib.sha256(f"{text}|{self.nbytes}".encode()).digest()


def block_tensors(block: nn.Module) -> list[tuple[str, TensorKind, torch.Tensor]]:
    """A block's parameters, then its buffers, in declaration order (tied tensors once)."""
    seen: set[int] = set()
    found: list[tuple[str, TensorKind, torch.Tensor]] = []
    for kind, named in (("parameter", block.named_parameters()), ("buffer", block.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((name, kind, tensor))  # type: ignore[arg-type]
    return found


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent buffer of `module` by local name: the buffers its ``state_dict`` (and so a checkpoint)
    holds, which offload streams or restores like parameters."""
    found: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def plan_layout(specs: list[tuple[str, TensorKind, torch.dtype, tuple[int, ...], tuple[int, ...]]]) -> BlockLayout:
    """Lay out tensors described as ``(name, kind, dtype, shape, stride)``."""
    by_dtype: dict[torch.dtype, list[tuple[str, TensorKind, torch.dtype, tuple[int, ...], tuple[int, ...]]]] = {}
    for spec in specs:
        name, _, _, shape, stride = spec
        if any(step == 0 and size > 1 for size, step in zip(shape, stride, strict=True)):
            raise ValueError(
                f"tensor {name!r} has overlapping memory (a stride of 0, e.g. from expand()); "
                "make it contiguous before enabling layerwise offload"
            )
        by_dtype.setdefault(spec[2], []).append(spec)
    entries: list[TensorEntry] = []
    offset = 0
    for group in by_dtype.values():
        for name, kind, dtype, shape, stride in group:
            entry = TensorEntry(name, kind, dtype, shape, stride, offset, storage_span(shape, stride))
            entries.append(entry)
            offset = _align(offset + entry.nbytes)
    return BlockLayout(tuple(entries), offset)


def layout_of(tensors: list[tuple[str, TensorKind, torch.Tensor]]) -> BlockLayout:
    return plan_layout([(n, k, t.dtype, tuple(t.shape), tuple(t.stride())) for n, k, t in tensors])


def pack_range(dst: torch.Tensor, start: int, layout: BlockLayout, sources: dict[str, torch.Tensor]) -> None:
    """Write bytes ``[start, start + dst.numel())`` of the packed block into `dst`.

    `dst` is a CPU ``uint8`` tensor. Only the entries overlapping the range are read,
    so a rank builds its shard without materialising the whole block. Bytes of
    `dst` outside every entry are set to zero, so padding is deterministic.
    """
    end = start + dst.numel()
    dst.zero_()
    for entry in layout.entries:
        lo, hi = entry.byte_offset, entry.byte_offset + entry.nbytes
        if hi <= start or lo >= end or entry.nbytes == 0:
            continue
        source = sources[entry.name]
        if lo >= start and hi <= end:
            shifted = replace(entry, byte_offset=lo - start)
            shifted.view_in(dst).copy_(source)
            continue
        image = torch.empty(entry.span_numel, dtype=entry.dtype)
        image.as_strided(entry.shape, entry.stride).copy_(source)
        image_bytes = image.view(torch.uint8)
        a, b = max(lo, start), min(hi, end)
        dst[a - start : b - start].copy_(image_bytes[a - lo : b - lo])


def layouts_digest(layouts: list[BlockLayout]) -> bytes:
    h = hashlib.sha256()
    for layout in layouts:
        h.update(layout.digest())
    return h.digest()
