"""Paged attention as a gather plus torch's SDPA: the best dense backend (cuDNN on H100/H200) over paged K/V.

Each run of adjacent rows with the same query and key lengths is one SDPA call: its pages are gathered into a
contiguous `[rows, seq_len, heads, head_size]` K and V (one indexed copy each, reading every page once), the
queries and the output are views of the packed token axis, and torch's dispatcher picks the backend (no mask
is passed, so cuDNN and flash stay eligible). The gather costs two reads and writes of the rows' K/V, which is
small next to the attention itself at long sequences (`4 * S * D` FLOPs per key byte pair).

It declines (`unsupported_reason` says why) what it cannot do exactly: a query inside its row's causal
prefix, grouped-query heads, metadata built without host row shapes, or an FP8 cache. Inputs are assumed
validated by `diffusion_kv.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from diffusion_kv._validation import cdiv
from diffusion_kv.ops.attention_metadata import HostRow, PagedAttentionMetadata, unmasked_rows_reason

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unsupported_reason(query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> str | None:
    """None when this path computes exactly what the reference does for the call, else the reason it declines."""
    if query.shape[1] != kv_cache.shape[3]:
        return f"grouped-query heads ({query.shape[1]} query heads over {kv_cache.shape[3]} kv heads)"
    if kv_cache.dtype not in _DTYPES:
        return f"cache dtype {kv_cache.dtype} (FP8 caches go through diffusion_kv.ops.fp8_attention)"
    return unmasked_rows_reason(metadata)


def _runs(rows: tuple[HostRow, ...]) -> list[tuple[int, int]]:
    """`[first, end)` index ranges of adjacent rows sharing query and key lengths (empty rows skipped)."""
    runs: list[tuple[int, int]] = []
    for index, row in enumerate(rows):
        if row.query_len == 0:
            continue
        if runs and runs[-1][1] == index:
            first = rows[runs[-1][0]]
            if (first.query_len, first.seq_len) == (row.query_len, row.seq_len):
                runs[-1] = (runs[-1][0], index + 1)
                continue
        runs.append((index, index + 1))
    return runs


def gather_kv(kv_cache: Tensor, block_tables: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """The rows' `[rows, seq_len, kv_heads, head_size]` K and V, read through `block_tables` (one copy each)."""
    block_size = kv_cache.shape[2]
    pages = block_tables[:, : cdiv(seq_len, block_size)].long()
    rows = pages.shape[0]
    keys = kv_cache[:, 0][pages].view(rows, -1, *kv_cache.shape[3:])[:, :seq_len]
    values = kv_cache[:, 1][pages].view(rows, -1, *kv_cache.shape[3:])[:, :seq_len]
    return keys, values


def paged_attention(
    query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, scale: float, out: Tensor | None
) -> Tensor:
    """Attention of every row; call only when `unsupported_reason` returned None.

    With `out`, the result is written into it. Without, a batch that is one run over every token returns SDPA's
    own output as `[tokens, heads, head_size]` (a view when SDPA laid it out token-major, as cuDNN does for
    token-major queries), so no output copy is made; otherwise a new tensor is filled.
    """
    rows = metadata.host_rows
    assert rows is not None, "checked by unsupported_reason"
    heads, head_size = query.shape[1:]
    runs = _runs(rows)
    if out is None:
        if len(runs) == 1 and _run_tokens(rows, runs[0]) == slice(0, query.shape[0]):
            return _attend_run(query, kv_cache, metadata, scale, rows, runs[0]).reshape(-1, heads, head_size)
        out = query.new_empty(query.shape)
    for run in runs:
        out[_run_tokens(rows, run)] = _attend_run(query, kv_cache, metadata, scale, rows, run).reshape(
            -1, heads, head_size
        )
    return out


def _run_tokens(rows: tuple[HostRow, ...], run: tuple[int, int]) -> slice:
    """The packed-token span of a run of adjacent equal rows."""
    first, end = run
    return slice(rows[first].query_start, rows[first].query_start + (end - first) * rows[first].query_len)


def _attend_run(
    query: Tensor,
    kv_cache: Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    rows: tuple[HostRow, ...],
    run: tuple[int, int],
) -> Tensor:
    """SDPA over one run of equal rows: `[rows, query_len, heads, head_size]` (a transposed view of SDPA's output)."""
    heads, head_size = query.shape[1:]
    first, end = run
    count, row = end - first, rows[first]
    tokens = _run_tokens(rows, run)
    keys, values = gather_kv(kv_cache, metadata.block_tables[first:end], row.seq_len)
    q = query[tokens].reshape(count, row.query_len, heads, head_size).transpose(1, 2)  # a view when packed
    result = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
    return result.transpose(1, 2)


__all__ = ["gather_kv", "paged_attention", "unsupported_reason"]
