"""Input validation shared by every backend of the paged K/V ops.

What is checked where:
- `PagedAttentionMetadata` checks its own types and shapes when it is made, and `build` its
  per-row values (on the host, before anything reaches the device): once per forward;
- every op call checks its tensors against the cache and the metadata (shapes, dtypes,
  devices, block size): attribute reads only;
- the bounds that depend on the pool (slots and block ids below its size) are checked when the
  metadata lives on the CPU; on CUDA reading them would synchronise the stream, and
  `diffusion_kv.batch` builds them from a row table that already validated every block id.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffusion_kv._validation import cdiv
from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kv_cache(kv_cache: Tensor, metadata: PagedAttentionMetadata) -> tuple[int, int]:
    """Check a paged cache against the forward's metadata; return `(num_kv_heads, head_size)`."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must have shape [num_blocks, 2, block_size, num_kv_heads, head_size] "
            f"(index 0 = K, 1 = V), got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype must be one of {CACHE_DTYPES}, got {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_size (stride(-1) == 1)")
    if kv_cache.shape[2] != metadata.block_size:
        raise ValueError(
            f"kv_cache has blocks of {kv_cache.shape[2]} tokens but the metadata was built for block_size="
            f"{metadata.block_size}"
        )
    if metadata.device != kv_cache.device:
        raise ValueError(f"the attention metadata is on {metadata.device} but kv_cache is on {kv_cache.device}")
    return kv_cache.shape[3], kv_cache.shape[4]


def _check_tokens(name: str, t: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> None:
    """One token per metadata token, in the cache's dtype and on its device."""
    if t.shape[0] != metadata.num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens but the metadata describes {metadata.num_tokens}")
    if t.dtype != kv_cache.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from kv_cache dtype {kv_cache.dtype}; cast it first")
    if t.device != kv_cache.device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def check_write_inputs(key: Tensor, value: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> None:
    """Checks of `write_kv_cache`; slot bounds only when the metadata is on the CPU."""
    num_kv_heads, head_size = check_kv_cache(kv_cache, metadata)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_size}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        _check_tokens(name, t, kv_cache, metadata)
    if metadata.device.type == "cpu" and metadata.num_tokens:
        num_slots = kv_cache.shape[0] * kv_cache.shape[2]
        highest = int(metadata.slot_mapping.max())
        if highest >= num_slots:
            raise ValueError(
                f"slot_mapping holds slot {highest}, beyond the pool's {num_slots} slots "
                f"({kv_cache.shape[0]} blocks x {kv_cache.shape[2]})"
            )


def check_attention_inputs(
    query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, out: Tensor | None
) -> None:
    """Checks of `paged_attention`; block-id bounds only when the metadata is on the CPU."""
    num_kv_heads, head_size = check_kv_cache(kv_cache, metadata)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must have shape [total_q, num_heads, {head_size}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({query.shape[1]}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})"
        )
    _check_tokens("query", query, kv_cache, metadata)
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(
            f"out must match query (shape {tuple(query.shape)}, {query.dtype}, {query.device}); "
            f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if metadata.device.type == "cpu":
        num_blocks = kv_cache.shape[0]
        for row, seq_len in enumerate(metadata.seq_lens.tolist()):
            used = metadata.block_tables[row, : cdiv(seq_len, metadata.block_size)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
                raise ValueError(f"row {row}: block ids {used.tolist()} must lie in [0, {num_blocks})")
