"""Paged K/V ops: write K/V through a slot mapping, and paged attention over block tables.

Layout (one tensor per cache-enabled layer or role): `kv_cache[num_blocks, 2, block_size,
num_kv_heads, head_size]`, index 0 = K, 1 = V, `num_blocks` the outer stride. Token
position `pos` of a row lives in slot `block_ids[pos // block_size] * block_size + pos % block_size`.

Dispatch: `backend="auto"` runs the Triton kernels on CUDA tensors and the torch reference
path elsewhere; `"torch"` and `"triton"` force one (`"triton"` on CPU tensors needs
`TRITON_INTERPRET=1` set before `diffusion_kv.ops.triton_kernels` is first imported).

Validation: shapes, dtypes and devices are checked on every call. Value bounds (slots,
block ids, positions) are checked whenever the index tensors live on the CPU; on CUDA
they are trusted, because reading them would synchronise the stream, and
`diffusion_kv.batch` builds them already validated.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from torch import Tensor

from diffusion_kv.ops import checks, reference

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


def _use_triton(backend: str, device_type: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if device_type != "cuda" and not triton_interpreter_active():
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before diffusion_kv.ops.triton_kernels is imported, or use backend='torch'"
            )
        return True
    return device_type == "cuda"


def triton_interpreter_active() -> bool:
    """True when the Triton kernels were (or will be) built for the CPU interpreter."""
    module = sys.modules.get("diffusion_kv.ops.triton_kernels")
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def write_kv_cache(
    key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *, backend: Backend = "auto"
) -> None:
    """Write K/V of `num_tokens` tokens into their slots of a paged cache.

    key/value: `[num_tokens, num_kv_heads, head_size]` in the cache dtype; they may be
    non-contiguous views of a packed QKV tensor (any strides; no copy is made).
    kv_cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]`.
    slot_mapping: int64 `[num_tokens]`, `slot = block_id * block_size + offset`; a negative
    slot skips its token. Only the given slots change.
    """
    checks.check_write_inputs(key, value, kv_cache, slot_mapping)
    if slot_mapping.device.type == "cpu":
        checks.check_slot_values(slot_mapping, kv_cache)
    if key.shape[0] == 0:
        return
    if _use_triton(backend, kv_cache.device.type):
        from diffusion_kv.ops import triton_kernels

        triton_kernels.write_kv_cache(key, value, kv_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    query_pos_start: Tensor,
    *,
    scale: float | None = None,
    causal_prefix_lens: Tensor | None = None,
    out: Tensor | None = None,
    max_query_len: int | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Attention of a ragged batch of R rows over keys read through each row's block table.

    query: `[total_q, num_heads, head_size]`, num_heads a multiple of the cache's num_kv_heads
    (GQA: query head h reads kv head `h // (num_heads // num_kv_heads)`).
    block_tables: int32 `[R, max_blocks_per_row]`. query_start_loc: int32 `[R+1]`; row r's
    queries are `query[query_start_loc[r]:query_start_loc[r+1]]`. seq_lens: int32 `[R]`; row r
    attends keys at positions `0..seq_lens[r]-1`. query_pos_start: int32 `[R]`; query i of row
    r sits at position `query_pos_start[r] + i`, which must be `< seq_lens[r]`.

    Non-causal by default. With `causal_prefix_lens` (int32 `[R]`) a query at position
    `p < causal_prefix_lens[r]` attends only keys `j <= p`; any later query attends all keys.
    `scale` defaults to `head_size ** -0.5`. Softmax runs in fp32. Returns
    `[total_q, num_heads, head_size]` in the query dtype, written into `out` when given.
    `max_query_len` (the longest row's query count) saves the CUDA path one host sync.
    """
    checks.check_attention_inputs(
        query, kv_cache, block_tables, query_start_loc, seq_lens, query_pos_start, causal_prefix_lens, out
    )
    if query_start_loc.device.type == "cpu":
        checks.check_attention_values(query, kv_cache, block_tables, query_start_loc, seq_lens, query_pos_start)
    if scale is None:
        scale = query.shape[2] ** -0.5
    if out is None:
        out = query.new_empty(query.shape)
    if query.shape[0] == 0:
        return out
    if _use_triton(backend, query.device.type):
        from diffusion_kv.ops import triton_kernels

        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        return triton_kernels.paged_attention(
            query, kv_cache, block_tables, query_start_loc, seq_lens, query_pos_start,
            scale, causal_prefix_lens, out, max_query_len,
        )
    return reference.paged_attention(
        query, kv_cache, block_tables, query_start_loc, seq_lens, query_pos_start, scale, causal_prefix_lens, out
    )


__all__ = ["Backend", "paged_attention", "triton_interpreter_active", "write_kv_cache"]
