"""The narrow block-allocator interface the manager reserves rows through.

Two implementations share one observable behaviour:

- ``diffusion_kv._vllm.NativeBlockAllocator`` drives vLLM's own
  ``KVCacheManager`` (the default whenever vLLM is importable);
- ``BuiltinBlockPool`` (here) is a small pure-Python pool for installs
  without vLLM.

Shared semantics (pinned by a parity test that runs the same operations on
both and compares block ids):

- block 0 is the *null block*, never handed out, so an idle pool of
  ``num_blocks`` reports ``num_blocks - 1`` free blocks;
- a row of ``n`` tokens owns ``ceil(n / block_size)`` blocks in each group,
  taken from the head of the free queue;
- ``allocate`` returns ``None`` (and changes nothing) when the free queue is
  too short: capacity, not an error;
- ``free`` returns a row's blocks in *physical* order (ascending block id) to
  the head of the free queue, so the next allocation gets adjacent pages
  again and KV connectors can coalesce them; freeing an id that owns nothing
  is a no-op.

An allocator knows nothing about CFG, contexts or public requests: the
manager composes rows into atomic reservations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from diffusion_kv._validation import cdiv, is_positive_int


class RowRequest(Protocol):
    """What an allocator reads from a row (a ``DiffusionKVRequest`` or a context shim)."""

    request_id: str
    num_tokens: int


@runtime_checkable
class BlockAllocator(Protocol):
    """Block ownership per row id; see the module docstring for semantics."""

    @property
    def num_groups(self) -> int:
        """KV-cache groups; every row gets one block list per group."""
        ...

    @property
    def empty_pool_free_blocks(self) -> int:
        """Free blocks of the idle pool (``num_blocks - 1``: the null block)."""
        ...

    def get_num_free_blocks(self) -> int: ...

    def blocks_for_full_reservation(self, num_tokens: int) -> int:
        """Blocks a fresh row of ``num_tokens`` tokens takes from an empty pool."""
        ...

    def allocate(self, request: RowRequest) -> tuple[list[int], ...] | None:
        """Give the row blocks for all ``request.num_tokens`` tokens, or return ``None``."""
        ...

    def free(self, request: RowRequest) -> None:
        """Return every block of the row in physical order; no-op for an unknown id."""
        ...

    def owned_request_ids(self) -> frozenset[str]:
        """Row ids that currently own at least one block (for invariant checks)."""
        ...


@dataclass(frozen=True)
class BlockPoolConfig:
    """Geometry of a pool when no vLLM ``KVCacheConfig`` is at hand.

    ``num_blocks`` includes the null block (so at least 2 are needed to hold
    anything); ``block_size`` is tokens per block. One KV-cache group.
    """

    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"BlockPoolConfig.{name} must be a positive integer, got {value!r}")


class BuiltinBlockPool:
    """Pure-Python block pool with the native allocator's observable semantics (one group)."""

    NULL_BLOCK_ID = 0

    def __init__(self, num_blocks: int, block_size: int) -> None:
        BlockPoolConfig(num_blocks, block_size)  # validates
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Block 0 is reserved as the null block, as in vLLM's BlockPool.
        self._free: deque[int] = deque(range(1, num_blocks))
        self._owned: dict[str, list[int]] = {}

    @classmethod
    def from_config(cls, config: BlockPoolConfig) -> BuiltinBlockPool:
        return cls(config.num_blocks, config.block_size)

    @property
    def num_groups(self) -> int:
        return 1

    @property
    def empty_pool_free_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for_full_reservation(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate(self, request: RowRequest) -> tuple[list[int], ...] | None:
        owned = self._owned.get(request.request_id, [])
        missing = self.blocks_for_full_reservation(request.num_tokens) - len(owned)
        if missing > len(self._free):
            return None
        if missing > 0:
            popleft = self._free.popleft
            owned = owned + [popleft() for _ in range(missing)]
            self._owned[request.request_id] = owned
        return (list(owned),)

    def free(self, request: RowRequest) -> None:
        blocks = self._owned.pop(request.request_id, None)
        if blocks:
            # Ascending ids at the queue head: the next allocation gets them
            # back in physical order (vLLM prepends non-cached frees the same way).
            self._free.extendleft(sorted(blocks, reverse=True))

    def owned_request_ids(self) -> frozenset[str]:
        return frozenset(self._owned)

    def __repr__(self) -> str:
        return (
            f"BuiltinBlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, rows={len(self._owned)})"
        )


AllocatorChoice = Literal["auto", "native", "builtin"]


def build_block_allocator(
    kv_cache_config: Any,
    *,
    allocator: AllocatorChoice,
    max_model_len: int,
    scheduler_block_size: int,
    hash_block_size: int,
    max_in_flight_tokens: int | None,
) -> BlockAllocator:
    """Build the allocator named by ``allocator`` for ``kv_cache_config``.

    ``kv_cache_config`` is a vLLM ``KVCacheConfig`` or a ``BlockPoolConfig``.
    ``"auto"`` picks the native allocator when vLLM is importable and the
    built-in pool otherwise; ``"native"`` without vLLM raises ``ImportError``
    naming what to install.
    """
    # Imported here, not at the top: the adapter imports this module. It
    # imports vLLM only inside the functions that need it.
    from diffusion_kv import _vllm

    if allocator not in ("auto", "native", "builtin"):
        raise ValueError(f"allocator must be 'auto', 'native', 'builtin' or a BlockAllocator, got {allocator!r}")
    use_native = allocator == "native" or (allocator == "auto" and _vllm.vllm_available())
    if use_native:
        if isinstance(kv_cache_config, BlockPoolConfig):
            kv_cache_config = _vllm.make_full_attention_kv_cache_config(
                kv_cache_config.num_blocks, kv_cache_config.block_size
            )
        return _vllm.NativeBlockAllocator(
            kv_cache_config,
            max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
        )
    if isinstance(kv_cache_config, BlockPoolConfig):
        return BuiltinBlockPool.from_config(kv_cache_config)
    return BuiltinBlockPool.from_config(_vllm.block_pool_config_from_kv_cache_config(kv_cache_config))


__all__ = [
    "AllocatorChoice",
    "BlockAllocator",
    "BlockPoolConfig",
    "BuiltinBlockPool",
    "RowRequest",
    "build_block_allocator",
]
