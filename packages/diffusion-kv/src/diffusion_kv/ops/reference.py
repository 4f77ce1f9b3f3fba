"""Torch reference implementations of the paged K/V ops.

These are the CPU path and the ground truth the Triton kernels are tested
against. They favour clarity over speed: attention runs row by row in fp32.
Inputs are assumed validated by `diffusion_kv.ops` (see `checks.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffusion_kv._validation import cdiv
from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> None:
    """Scatter each token's K/V into `kv_cache[slot // B, {0,1}, slot % B]`; negative slots are skipped."""
    block_size = kv_cache.shape[2]
    slots = metadata.slot_mapping
    keep = slots >= 0
    slots = slots[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    kv_cache[blocks, 0, offsets] = key[keep]
    kv_cache[blocks, 1, offsets] = value[keep]


def gather_row_kv(kv_cache: Tensor, block_table_row: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Return one row's `[seq_len, num_kv_heads, head_size]` K and V, read through its block table."""
    block_size = kv_cache.shape[2]
    num_used = cdiv(seq_len, block_size)
    pages = kv_cache[block_table_row[:num_used].to(torch.int64)]  # [n, 2, B, Hkv, D]
    keys = pages[:, 0].reshape(num_used * block_size, *kv_cache.shape[3:])[:seq_len]
    values = pages[:, 1].reshape(num_used * block_size, *kv_cache.shape[3:])[:seq_len]
    return keys, values


def paged_attention(
    query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, scale: float, out: Tensor
) -> Tensor:
    """Row-by-row attention in fp32 over keys read through each row's block table; writes `out`."""
    group = query.shape[1] // kv_cache.shape[3]
    qsl = metadata.query_start_loc.tolist()
    starts = metadata.query_pos_start.tolist()
    causal = metadata.causal_prefix_lens
    prefix_lens = causal.tolist() if causal is not None else None
    for row, seq_len in enumerate(metadata.seq_lens.tolist()):
        q_lo, q_hi = qsl[row], qsl[row + 1]
        if q_hi == q_lo:
            continue
        keys, values = gather_row_kv(kv_cache, metadata.block_tables[row], seq_len)
        q = query[q_lo:q_hi].float().transpose(0, 1)  # [H, q, D]
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q, S]
        if prefix_lens is not None:
            positions = torch.arange(starts[row], starts[row] + (q_hi - q_lo), device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            allowed = (positions[:, None] >= prefix_lens[row]) | (key_pos[None, :] <= positions[:, None])
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
