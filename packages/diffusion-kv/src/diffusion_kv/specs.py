"""Attention-layer opt-in to the paged K/V cache, and spec discovery over a model.

An attention module opts in by setting `self.diffusion_kv_cache = KVCacheOptIn(...)`.
Nothing else about the module changes: it adds no parameters or buffers, so
`state_dict()` is unaffected. `discover_kv_cache_specs` walks `named_modules()` and
returns one `AttentionCacheSpec` per opted-in layer, in module order.

Physical geometry (K/V heads, head size, dtype) lives here; the block size is a
pool-wide choice made at sizing time (`diffusion_kv.sizing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffusion_kv._validation import check_positive_int
from diffusion_kv.ops.checks import CACHE_DTYPES

# The role of the request's own token axis ([prefix | target] of every CFG row); context roles name the rest.
PRIMARY_CACHE_ROLE = "primary"


@dataclass(frozen=True)
class KVCacheOptIn:
    """What a cache-enabled attention layer stores: its cache role and K/V geometry.

    `cache_role` names the logical cache the layer reads and writes (`PRIMARY_CACHE_ROLE` for the
    request's own token axis, or a context role such as `"ar_decode"`); one forward only
    ever touches rows of one role.
    """

    cache_role: str
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.cache_role, str) or not self.cache_role:
            raise ValueError(f"cache_role must be a non-empty str, got {self.cache_role!r}")
        for name in ("num_kv_heads", "head_size"):
            check_positive_int(name, getattr(self, name))
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {CACHE_DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class AttentionCacheSpec:
    """One cache-enabled layer: its module path, role and per-token K/V geometry."""

    layer_name: str
    cache_role: str
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K plus V bytes one token occupies in this layer's cache."""
        return 2 * self.num_kv_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block (page) of this layer's cache."""
        return block_size * self.bytes_per_token

    @property
    def geometry(self) -> tuple[int, int, torch.dtype]:
        """`(num_kv_heads, head_size, dtype)`: layers that share it can share one physical layout."""
        return (self.num_kv_heads, self.head_size, self.dtype)


def discover_kv_cache_specs(model: nn.Module) -> dict[str, AttentionCacheSpec]:
    """Map each opted-in layer's module path to its spec, in `named_modules()` order.

    Raises TypeError if a module's `diffusion_kv_cache` is neither None nor a KVCacheOptIn,
    and RuntimeError naming the model class if no layer opted in (paged mode needs one).
    """
    specs: dict[str, AttentionCacheSpec] = {}
    for name, module in model.named_modules():
        opt_in = getattr(module, "diffusion_kv_cache", None)
        if opt_in is None:
            continue
        if not isinstance(opt_in, KVCacheOptIn):
            raise TypeError(
                f"{type(module).__name__} at {name or '<root>'!r} sets diffusion_kv_cache to "
                f"{type(opt_in).__name__}; it must be a diffusion_kv.KVCacheOptIn or None"
            )
        specs[name] = AttentionCacheSpec(
            layer_name=name,
            cache_role=opt_in.cache_role,
            num_kv_heads=opt_in.num_kv_heads,
            head_size=opt_in.head_size,
            dtype=opt_in.dtype,
        )
    if not specs:
        raise RuntimeError(
            f"diffusion_kv found no cache-enabled Attention modules in {type(model).__name__}; set "
            "`diffusion_kv_cache = KVCacheOptIn(...)` on its attention layers to page their K/V"
        )
    return specs


def registered_roles(specs: dict[str, AttentionCacheSpec]) -> frozenset[str]:
    """The cache roles the discovered layers expose."""
    return frozenset(spec.cache_role for spec in specs.values())
