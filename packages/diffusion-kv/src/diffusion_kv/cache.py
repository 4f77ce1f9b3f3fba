"""Physical paged K/V cache tensors.

One tensor per cache-enabled layer, shaped `[num_blocks, 2, block_size, num_kv_heads,
head_size]` in the layer's cache dtype: `num_blocks` is the outer stride (a block id
indexes every layer's tensor), index 0 of dim 1 is K and 1 is V, and one block of K (or
V) is `block_size x num_kv_heads x head_size` contiguous elements. This is the layout
`diffusion_kv.ops` reads and writes.
"""

from __future__ import annotations

import torch

from diffusion_kv._validation import check_positive_int
from diffusion_kv.specs import AttentionCacheSpec


def kv_cache_shape(spec: AttentionCacheSpec, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache tensor."""
    return (num_blocks, 2, block_size, spec.num_kv_heads, spec.head_size)


def allocate_kv_caches(
    specs: dict[str, AttentionCacheSpec],
    num_blocks: int,
    block_size: int,
    *,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Allocate (zeroed) one cache tensor per layer, keyed and ordered like `specs`.

    Zeroing costs one pass at start-up and makes a read of a never-written slot
    (a caller bug) deterministic instead of whatever the allocator held.
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        check_positive_int(name, value)
    if not specs:
        raise ValueError("no cache-enabled layers: nothing to allocate")
    return {
        name: torch.zeros(kv_cache_shape(spec, num_blocks, block_size), dtype=spec.dtype, device=device)
        for name, spec in specs.items()
    }


def kv_cache_bytes(caches: dict[str, torch.Tensor]) -> int:
    """Device bytes held by a set of cache tensors."""
    return sum(t.numel() * t.element_size() for t in caches.values())
