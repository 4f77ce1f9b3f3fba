"""omni's dense attention entry point for the diffusers families: one function, the fastest correct backend.

Layout ``[batch, seq, heads, head_dim]`` (what the families' projections produce). Every row attends over all
of its keys (non-causal), except that a batch may be *ragged at its end*: with ``RowLengths(lengths)`` row ``r``
uses only its first ``lengths[r]`` positions, as queries and as keys; its later positions are padding, never
attended to, and their outputs are zeros. That lets requests whose prompts have different lengths share one
forward without changing any real token's result (a joint text+image layer puts the text last for this, so
that each row's padding is a tail).

Backends, tried in order (the first whose ``supports`` accepts the call runs it):
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` without a mask, so on CUDA torch's dispatcher
  can pick cuDNN (the fastest on H100/H200 at DiT shapes); a ragged batch runs one unmasked call per group of
  rows with equal length, on views of the rows' leading positions (no copy of Q, K or V when a group's rows
  are adjacent), rather than one masked call (a mask would rule cuDNN and flash out).
A faster omni kernel slots in by adding an ``AttentionBackend`` ahead of it in ``BACKENDS``.

``dtype="fp8"`` (opt-in: ``load(attention_dtype="fp8")``, ``omni-server --attention-dtype fp8``) runs
``fp8_attention`` instead: diffusion-kv's FP8 attention (``float8_e4m3fn`` queries, keys and values with one scale
per head, softmax in fp32; its Triton kernel on CUDA with compute capability 9.0+, its torch reference elsewhere).
Each row gets its own scales (a row's output never depends on its batch neighbours), over a K/V cache of the row's
own pages written for the call. Error against this module's default path: stated in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from omni_models.registry import AttentionDtype

FP8_PAGE = 64  # the FP8 kernel reads pages of a multiple of 64 tokens


@dataclass(frozen=True)
class RowLengths:
    """Row ``r`` of a padded batch uses only its first ``lengths[r]`` positions (queries and keys)."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or not all(isinstance(n, int) and n > 0 for n in self.lengths):
            raise ValueError(f"row lengths {self.lengths} must be positive ints, one per row")

    def uniform(self, padded_len: int) -> bool:
        return all(n == padded_len for n in self.lengths)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports: Callable[[Tensor, RowLengths | None], bool]
    run: Callable[[Tensor, Tensor, Tensor, RowLengths | None], Tensor]


def _sdpa(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Unmasked SDPA over ``[B, S, H, D]`` tensors, in the same transposed layout diffusers' native backend uses."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out.transpose(1, 2)


def _row_groups(lengths: tuple[int, ...]) -> list[tuple[int, slice | list[int]]]:
    """``(length, rows)`` per distinct length; ``rows`` is a slice when the group's rows are adjacent."""
    groups = []
    for length in sorted(set(lengths)):
        members = [r for r, n in enumerate(lengths) if n == length]
        adjacent = members == list(range(members[0], members[-1] + 1))
        groups.append((length, slice(members[0], members[-1] + 1) if adjacent else members))
    return groups


def _sdpa_rows(query: Tensor, key: Tensor, value: Tensor, lengths: RowLengths | None) -> Tensor:
    padded_len = query.shape[1]
    if lengths is None or lengths.uniform(padded_len):
        return _sdpa(query, key, value)
    if len(lengths.lengths) != query.shape[0]:
        raise ValueError(f"RowLengths has {len(lengths.lengths)} lengths for a batch of {query.shape[0]} rows")
    if max(lengths.lengths) > padded_len:
        raise ValueError(f"row lengths {lengths.lengths} exceed the padded length {padded_len}")
    out = torch.empty_like(query)
    for row, length in enumerate(lengths.lengths):
        out[row, length:] = 0
    for length, rows in _row_groups(lengths.lengths):
        out[rows, :length] = _sdpa(*(x[rows, :length] for x in (query, key, value)))
    return out


BACKENDS: list[AttentionBackend] = [
    AttentionBackend("sdpa", supports=lambda query, lengths: True, run=_sdpa_rows),
]


def select_backend(query: Tensor, lengths: RowLengths | None = None) -> AttentionBackend:
    for backend in BACKENDS:
        if backend.supports(query, lengths):
            return backend
    raise RuntimeError(f"no attention backend supports {query.dtype} {tuple(query.shape)} on {query.device}")


def attention(
    query: Tensor, key: Tensor, value: Tensor, lengths: RowLengths | None = None, *, dtype: AttentionDtype = "auto"
) -> Tensor:
    """Non-causal attention over ``[B, S, H, D]`` tensors (optionally ragged: each row's first ``lengths[r]``);
    ``dtype="fp8"``: ``fp8_attention``."""
    if not query.shape == key.shape == value.shape:
        raise ValueError(f"query, key and value shapes differ: {query.shape}, {key.shape}, {value.shape}")
    if dtype == "fp8":
        return fp8_attention(query, key, value, lengths)
    return select_backend(query, lengths).run(query, key, value, lengths)


def fp8_attention(query: Tensor, key: Tensor, value: Tensor, lengths: RowLengths | None = None) -> Tensor:
    """``attention`` in FP8 (module docstring): ``[B, S, H, D]`` in, the same shape and dtype out, padding
    positions of a ragged batch zero. One opaque op to ``torch.compile`` (the kernel's launch reads host ints)."""
    if lengths is not None and len(lengths.lengths) != query.shape[0]:
        raise ValueError(f"RowLengths has {len(lengths.lengths)} lengths for a batch of {query.shape[0]} rows")
    if lengths is not None and max(lengths.lengths) > query.shape[1]:
        raise ValueError(f"row lengths {lengths.lengths} exceed the padded length {query.shape[1]}")
    return _fp8_attention(query, key, value, [] if lengths is None else list(lengths.lengths))


@functools.lru_cache(maxsize=2)  # two shapes (a Wan2.1-14B row at 480p: 335 MB each)
def _fp8_row_cache(length: int, heads: int, head_size: int, device: torch.device) -> tuple[Tensor, Any]:
    """A zeroed FP8 K/V cache of ``length`` tokens in pages of its own, and the metadata of one row over it, kept
    for the next call of that shape (a forward's layers all attend at one length): each call overwrites the row's
    slots, and the last page's tail, never attended to, holds finite values only."""
    from diffusion_kv.ops import PagedAttentionMetadata
    from diffusion_kv.ops.fp8_attention import FP8_DTYPE

    pages = -(-length // FP8_PAGE)
    cache = torch.zeros(pages, 2, FP8_PAGE, heads, head_size, dtype=FP8_DTYPE, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    metadata = PagedAttentionMetadata.build(
        table, block_size=FP8_PAGE, query_lens=[length], seq_lens=[length], query_pos_start=[0]
    )
    return cache, metadata


@torch.library.custom_op("omni_models::fp8_attention", mutates_args=())
def _fp8_attention(query: Tensor, key: Tensor, value: Tensor, lengths: list[int]) -> Tensor:
    from diffusion_kv.ops.fp8_attention import (
        paged_attention_fp8,
        per_head_scales,
        quantize_per_head,
        write_kv_cache_fp8,
    )

    _, padded_len, heads, head_size = query.shape
    out = torch.zeros_like(query)
    for row in range(query.shape[0]):
        length = lengths[row] if lengths else padded_len
        q, k, v = (t[row, :length].contiguous() for t in (query, key, value))
        q_scale, k_scale, v_scale = per_head_scales(q), per_head_scales(k), per_head_scales(v)
        cache, metadata = _fp8_row_cache(length, heads, head_size, query.device)
        write_kv_cache_fp8(k, v, cache, metadata, k_scale, v_scale)
        paged_attention_fp8(
            quantize_per_head(q, q_scale), q_scale, cache, k_scale, v_scale, metadata, out=out[row, :length]
        )
    return out


@_fp8_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, lengths: list[int]) -> Tensor:
    return torch.empty_like(query)


def row_lengths(lengths: Sequence[int], padded_len: int) -> RowLengths | None:
    """None when every row uses all ``padded_len`` positions (the plain, fastest path)."""
    lengths = tuple(int(n) for n in lengths)
    return None if all(n == padded_len for n in lengths) else RowLengths(lengths)
