"""Host-side copies of the streamed blocks, packed once at enable time.

Each streamed block is packed (see `layout`) into its own host buffer: the whole
block in rank-local mode, or this rank's equal, zero-padded 1/G shard in AllGather
mode. Buffers are pinned when the device is CUDA so H2D copies are asynchronous
DMA; if the driver refuses to pin, the store falls back to pageable memory and
warns once (copies then still work, but stall the host).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

import torch

from .layout import BlockLayout, pack_range

logger = logging.getLogger(__name__)


def allocate_host_bytes(nbytes: int, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """A CPU ``uint8`` buffer of `nbytes`, pinned when asked and allowed.

    Returns ``(buffer, pinned)``. A refused pin (no driver, locked-memory limit)
    falls back to pageable memory with a warning instead of failing the enable.
    """
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:
            warnings.warn(
                f"pinning {nbytes} bytes of host memory was refused ({exc}); falling back to pageable "
                "memory, so host-to-device copies will be slower and will block the host. "
                "Raise the locked-memory limit (ulimit -l) or pass pin_memory=False to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
    return torch.empty(nbytes, dtype=torch.uint8), False


class HostBlockStore:
    """Packed host bytes of every streamed block for one rank.

    Invariants: ``buffers[k]`` holds bytes ``[rank * shard_k, (rank + 1) * shard_k)``
    of block k's packed layout, where ``shard_k = layouts[k].shard_nbytes(world_size)``
    (``world_size == 1`` means the whole block); bytes past the block's end are zero.
    """

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Callable[[int], dict[str, torch.Tensor]],
        *,
        world_size: int,
        rank: int,
        pin: bool,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of size {world_size}")
        self.layouts = tuple(layouts)
        self.world_size = world_size
        self.rank = rank
        self.buffers: list[torch.Tensor] = []
        self.pinned = bool(layouts) and pin
        for k, layout in enumerate(self.layouts):
            shard = layout.shard_nbytes(world_size)
            buffer, pinned = allocate_host_bytes(shard, pin=self.pinned)
            self.pinned = self.pinned and pinned
            pack_range(buffer, rank * shard, layout, sources(k))
            self.buffers.append(buffer)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


class StagedCheckpointBlocks:
    """Rank-local blocks read from checkpoint mappings at copy time, through two pinned staging buffers.

    No private host copy of the blocks exists: their bytes stay in the safetensors
    files' page-cache mappings (shared by every process on the node that maps the
    same files). Before each H2D copy, the block is packed into staging buffer
    ``slot``; the host first waits for the previous copy out of that buffer, which
    finished long ago unless the device is more than two blocks behind.
    Invariant: ``staging[s]`` is only rewritten after ``done[s]`` (recorded after the
    copy that read it) has completed.
    """

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Sequence[dict[str, torch.Tensor]],
        *,
        pin: bool,
        new_event: Callable[[], object],
    ) -> None:
        self.layouts = tuple(layouts)
        self._sources = list(sources)
        largest = max((layout.nbytes for layout in self.layouts), default=0)
        first, pinned = allocate_host_bytes(largest, pin=pin)
        second, pinned_too = allocate_host_bytes(largest, pin=pin and pinned)
        self.staging = (first, second)
        self.pinned = pinned and pinned_too
        self.done = (new_event(), new_event())

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.staging)

    def stage(self, k: int, slot: int) -> torch.Tensor:
        """Pack block k into staging buffer `slot` and return the bytes to copy."""
        self.done[slot].synchronize()  # type: ignore[attr-defined]
        target = self.staging[slot][: self.layouts[k].nbytes]
        pack_range(target, 0, self.layouts[k], self._sources[k])
        return target
