"""Input validation shared by every backend of the paged K/V ops.

Shape, dtype and device checks are cheap and run on every call. Value checks
(slot ranges, block ids, sequence bounds) read small index tensors on the host;
the torch path runs them on every call, the CUDA path only when asked, because
reading a CUDA tensor on the host synchronises the stream. The batch builder
(`diffusion_kv.batch`) produces values that already satisfy them.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kv_cache(kv_cache: Tensor) -> tuple[int, int, int, int]:
    """Return `(num_blocks, block_size, num_kv_heads, head_size)` of a paged cache."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must have shape [num_blocks, 2, block_size, num_kv_heads, head_size] "
            f"(index 0 = K, 1 = V), got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype must be one of {SUPPORTED_CACHE_DTYPES}, got {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_size (stride(-1) == 1)")
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    return num_blocks, block_size, num_kv_heads, head_size


def check_write_inputs(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Shape/dtype/device checks of `write_kv_cache` (no host reads)."""
    _, _, num_kv_heads, head_size = check_kv_cache(kv_cache)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_size}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from kv_cache dtype {kv_cache.dtype}; cast it first")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must have shape [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}")


def check_slot_values(slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Every non-negative slot must address the pool (reads slot_mapping on the host)."""
    num_slots = kv_cache.shape[0] * kv_cache.shape[2]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, beyond the pool's {num_slots} slots "
            f"({kv_cache.shape[0]} blocks x {kv_cache.shape[2]})"
        )


def check_attention_inputs(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    query_pos_start: Tensor,
    causal_prefix_lens: Tensor | None,
    out: Tensor | None,
) -> None:
    """Shape/dtype/device checks of `paged_attention` (no host reads)."""
    _, _, num_kv_heads, head_size = check_kv_cache(kv_cache)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must have shape [total_q, num_heads, {head_size}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({query.shape[1]}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})"
        )
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if query.device != kv_cache.device:
        raise ValueError(f"query is on {query.device} but kv_cache is on {kv_cache.device}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must have shape [num_rows, max_blocks_per_row], got {tuple(block_tables.shape)}")
    num_rows = block_tables.shape[0]
    named = [
        ("block_tables", block_tables, None),
        ("query_start_loc", query_start_loc, (num_rows + 1,)),
        ("seq_lens", seq_lens, (num_rows,)),
        ("query_pos_start", query_pos_start, (num_rows,)),
    ]
    if causal_prefix_lens is not None:
        named.append(("causal_prefix_lens", causal_prefix_lens, (num_rows,)))
    for name, t, shape in named:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 tensor, got {t.dtype}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for {num_rows} rows, got {tuple(t.shape)}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(
                f"out must match query (shape {tuple(query.shape)}, {query.dtype}, {query.device}); "
                f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}"
            )


def check_attention_values(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    query_pos_start: Tensor,
) -> None:
    """Per-row bounds of `paged_attention` (reads the small index tensors on the host)."""
    num_blocks, block_size, _, _ = check_kv_cache(kv_cache)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    starts = query_pos_start.tolist()
    if qsl[0] != 0 or qsl[-1] != query.shape[0]:
        raise ValueError(f"query_start_loc must start at 0 and end at total_q={query.shape[0]}, got {qsl}")
    capacity = block_tables.shape[1] * block_size
    for row, (seq_len, start) in enumerate(zip(lens, starts)):
        num_queries = qsl[row + 1] - qsl[row]
        if num_queries < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, got {qsl}")
        if start < 0 or seq_len < 0:
            raise ValueError(f"row {row}: query_pos_start ({start}) and seq_len ({seq_len}) must be non-negative")
        if start + num_queries > seq_len:
            raise ValueError(
                f"row {row}: queries at positions {start}..{start + num_queries - 1} lie beyond seq_len={seq_len}; "
                "a row's keys must include every query position"
            )
        if seq_len > capacity:
            raise ValueError(
                f"row {row}: seq_len={seq_len} exceeds the block table width "
                f"({block_tables.shape[1]} blocks x {block_size} = {capacity} tokens)"
            )
        used = block_tables[row, : -(-seq_len // block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"row {row}: block ids {used.tolist()} must lie in [0, {num_blocks})")
