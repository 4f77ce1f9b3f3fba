"""The streaming executor: forward hooks that page block weights through two device slots.

While block k computes, block k+1's packed bytes are copied (and, in AllGather
mode, gathered from every rank's shard) into the other slot on a side stream.
Ordering is by events only, so the host never waits for the device in the hot path
(streaming from the checkpoint adds one wait, for the staging buffer's last copy):

* ``ready[s]``  recorded on the transfer stream after slot s is filled; the compute
  stream waits on it before the block that lives in s runs.
* ``free[s]``   recorded on the compute stream after the block in s has run; the
  transfer stream waits on it before overwriting s.

Outside its forward a streamed block's tensors are zero-size placeholders on the
device, so a block used out of turn fails loudly instead of reading stale bytes.
Device weight memory is the resident blocks and modules plus exactly two slots,
each the size of the largest (padded) streamed block.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ._device import DeviceOps, Event, Stream
from ._tensors import SavedTensor, owner_of, set_tensor
from .checkpoint import CHECKPOINT_MMAP, CheckpointReader, HostWeightPlan
from .host_store import HostBlockStore, StagedCheckpointBlocks
from .layout import BlockLayout, TensorEntry, block_tensors, layout_of, layouts_digest, persistent_buffers
from .plan import OffloadPlan, ResolvedPlan, resolve_plan
from .rules import check_allgather_plan

logger = logging.getLogger(__name__)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Mode = Literal["allgather", "rank_local"]


@dataclass
class _StreamedBlock:
    name: str
    module: nn.Module
    targets: list[tuple[nn.Module, str, TensorEntry]]
    slot_views: tuple[list[torch.Tensor], list[torch.Tensor]]
    placeholders: list[torch.Tensor]
    requires_grad: bool
    active_slot: int = -1  # the slot its tensors point into while it runs


class SlotState(enum.Enum):
    """Where a device slot is in its cycle, as the host sees it (the device may still be behind)."""

    EMPTY = "empty"  # holds no block yet
    FILLED = "filled"  # a copy of `tenant` is enqueued on the transfer stream; `ready` marks its end
    COMPUTING = "computing"  # `tenant`'s forward reads it, between the block's pre- and post-hook
    RELEASED = "released"  # `tenant` ran and `free` is recorded; its bytes stay valid until the next fill


@dataclass
class _Slot:
    """One of the two device slots a streamed block runs from."""

    buffer: torch.Tensor
    ready: Event  # recorded on the transfer stream after each fill
    free: Event  # recorded on the compute stream after the tenant's forward
    state: SlotState = SlotState.EMPTY
    tenant: int | None = None  # the streamed block whose bytes it holds (or is receiving)


class LayerwiseOffload:
    """Handle for an enabled layerwise offload; `remove()` restores the model.

    Attributes:
        mode: ``"allgather"`` (each rank holds 1/G of every block and the block is
            rebuilt with an all-gather) or ``"rank_local"`` (whole blocks from this
            rank's host copy).
        world_size, rank: the sharding group's shape (1, 0 in rank-local mode).
        slot_nbytes: bytes of one device slot (largest padded streamed block).
        resident_nbytes: bytes of weights kept on the device (resident blocks and modules).
        host_nbytes: bytes of packed block data held on this rank's host.
        pinned: whether the host copies (or staging buffers) are pinned.
        streams_from_checkpoint: whether blocks are packed from the checkpoint mapping per copy.

    In a profiler trace each streamed block's copy shows as ``dlo_offload.h2d <block>`` (its all-gather
    inside it, in AllGather mode) and its forward as ``dlo_offload.forward <block>``.
    """

    def __init__(self) -> None:
        # -- public figures (set by the enable) ------------------------------------------
        self.mode: Mode = "rank_local"
        self.world_size = 1
        self.rank = 0
        self.slot_nbytes = 0
        self.resident_nbytes = 0
        self.host_nbytes = 0
        self.pinned = False
        # -- device and sharding group ------------------------------------------------------
        self._ops: DeviceOps | None = None
        self._group: dist.ProcessGroup | None = None
        # -- host side: exactly one of a packed copy per block or checkpoint staging ------------
        self._store: HostBlockStore | None = None
        self._staged: StagedCheckpointBlocks | None = None
        self._reader: CheckpointReader | None = None  # kept open while blocks stream from the checkpoint
        # -- device side: the streamed blocks, the two slots, the copy stream ---------------------
        self._streamed: list[_StreamedBlock] = []
        self._slots: tuple[_Slot, ...] = ()
        self._transfer: Stream | None = None
        self._last_slot = 1  # the slot the most recent block ran from
        # -- what the model held before, for remove() and rollback ---------------------------------
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._moved: list[SavedTensor] = []  # resident blocks and modules
        self._originals: list[SavedTensor] = []  # streamed tensors, until the enable completes
        self._forward_ranges: dict[int, torch.profiler.record_function] = {}
        self._removed = False

    @property
    def host_block_buffers(self) -> tuple[torch.Tensor, ...]:
        """The packed host buffers, one per streamed block (this rank's shard in AllGather
        mode); read-only use, e.g. to time a plain copy of the same bytes."""
        return tuple(self._store.buffers) if self._store is not None else ()

    @property
    def streams_from_checkpoint(self) -> bool:
        return self._staged is not None

    # ----------------------------------------------------------------- enable
    def _enable(
        self,
        model: nn.Module,
        plan: OffloadPlan,
        ops: DeviceOps,
        group: dist.ProcessGroup | None,
        use_allgather: bool,
        pin_memory: bool,
        host_weights: HostWeightPlan | None,
        stream_from_checkpoint: bool,
    ) -> None:
        resolved = resolve_plan(model, plan)
        if group is not None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialized: enable_layerwise_offload(group=...) shards weights over "
                    "a process group; call torch.distributed.init_process_group first, or pass group=None"
                )
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if group is not None:
            check_allgather_plan(plan.resident_blocks, use_allgather=use_allgather)
        self.mode = "allgather" if use_allgather and self.world_size > 1 else "rank_local"
        if use_allgather and group is not None and self.world_size == 1:
            logger.info("Distributed layerwise offload: DLO group has one rank; streaming rank-local blocks")
        if self.mode == "rank_local":
            self.world_size, self.rank = 1, 0
        self._ops, self._group = ops, group

        streamed = resolved.streamed
        tensors = [block_tensors(block) for _, block in streamed]
        for (block_name, _), block_ts in zip(streamed, tensors, strict=True):
            for local, _, tensor in block_ts:
                if type(tensor) not in (torch.Tensor, nn.Parameter):
                    raise ValueError(
                        f"{block_name}.{local} is a {type(tensor).__name__}; layerwise offload streams plain "
                        "tensors only (for HSDP/DTensor parameters use the ordinary loader without sharding)"
                    )
        if host_weights is not None and host_weights.backing_kind != CHECKPOINT_MMAP:
            raise ValueError(f"Unsupported DLO host-weight backing: {host_weights.backing_kind}")
        if stream_from_checkpoint and host_weights is None:
            raise ValueError(
                "stream_from_checkpoint=True needs host_weights= from build_checkpoint_mmap_plan: blocks can "
                "only be read at copy time from a preflighted checkpoint"
            )
        if stream_from_checkpoint and self.mode == "allgather":
            raise ValueError(
                "stream_from_checkpoint=True is rank-local only (in AllGather mode each rank keeps its 1/G "
                "shard in host memory); pass use_allgather=False or drop stream_from_checkpoint"
            )
        layouts = [layout_of(ts) for ts in tensors]
        if self.mode == "allgather":
            self._check_layouts_agree(layouts)
        reader = host_weights.open() if host_weights is not None else None
        pin = pin_memory and ops.is_cuda
        keep_reader_open = False
        try:
            if stream_from_checkpoint:
                # Detached `.data` handles: the module's own tensors become placeholders below.
                sources = [
                    {n: t.data for n, t in self._sources(streamed[k], tensors[k], reader).items()}
                    for k in range(len(streamed))
                ]
                self._staged = StagedCheckpointBlocks(layouts, sources, pin=pin, new_event=ops.new_event)
                self._reader, keep_reader_open = reader, True
                self.host_nbytes, self.pinned = self._staged.nbytes, self._staged.pinned
            else:
                self._store = HostBlockStore(
                    layouts,
                    lambda k: self._sources(streamed[k], tensors[k], reader),
                    world_size=self.world_size if self.mode == "allgather" else 1,
                    rank=self.rank if self.mode == "allgather" else 0,
                    pin=pin,
                )
                self.host_nbytes, self.pinned = self._store.nbytes, self._store.pinned
            # Everything above only read the model; from here on it is mutated and
            # `_rollback` knows how to undo each step.
            self._place_resident(resolved, ops.device, reader)
        finally:
            if reader is not None and not keep_reader_open:
                reader.close()
        self._build_slots(streamed, tensors, layouts)
        self._transfer = ops.new_stream()
        for k, block in enumerate(self._streamed):
            self._hooks.append(block.module.register_forward_pre_hook(self._make_pre_hook(k)))
            self._hooks.append(block.module.register_forward_hook(self._make_post_hook(k), always_call=True))
        if self._streamed:
            self._fill(0, 0)
        self._originals.clear()
        ops.synchronize()

    def _check_layouts_agree(self, layouts: list[BlockLayout]) -> None:
        mine = torch.frombuffer(bytearray(layouts_digest(layouts)), dtype=torch.uint8).to(self._gather_device())
        every = torch.empty(mine.numel() * self.world_size, dtype=torch.uint8, device=mine.device)
        _all_gather_single(every, mine, group=self._group)
        digests = every.view(self.world_size, -1).cpu()
        if not all(torch.equal(digests[0], d) for d in digests):
            raise RuntimeError(
                "DLO ranks disagree on the streamed block layout (names, dtypes, shapes or strides differ); "
                "every rank of the AllGather group must build the same model with the same OffloadPlan"
            )

    def _sources(
        self,
        named: tuple[str, nn.Module],
        tensors: list[tuple[str, str, torch.Tensor]],
        reader: CheckpointReader | None,
    ) -> dict[str, torch.Tensor]:
        block_name, block = named
        persistent = persistent_buffers(block)
        out: dict[str, torch.Tensor] = {}
        for local, kind, tensor in tensors:
            planned = reader is not None and (kind == "parameter" or local in persistent)
            if planned:
                out[local] = reader.get(f"{block_name}.{local}")
                if tuple(out[local].shape) != tuple(tensor.shape) or out[local].dtype != tensor.dtype:
                    raise ValueError(
                        f"host_weights binds {block_name}.{local} to a {out[local].dtype} tensor of shape "
                        f"{tuple(out[local].shape)}, but the model has {tensor.dtype} {tuple(tensor.shape)}; "
                        "rebuild the plan with build_checkpoint_mmap_plan for this model"
                    )
            elif tensor.is_meta:
                raise ValueError(
                    f"{block_name}.{local} is on the meta device and no host_weights plan provides it; "
                    "load the weights first, or pass host_weights= from build_checkpoint_mmap_plan"
                )
            else:
                out[local] = tensor
        return out

    def _place_resident(self, resolved: ResolvedPlan, device: torch.device, reader: CheckpointReader | None) -> None:
        modules = [(name, block, reader) for name, block in resolved.resident]
        modules += [(name, module, None) for name, module in resolved.resident_modules]
        for prefix, module, source in modules:
            persistent = persistent_buffers(module)
            for local, kind, tensor in block_tensors(module):
                owner, attr = owner_of(module, local)
                planned = source is not None and (kind == "parameter" or local in persistent)
                value = source.get(f"{prefix}.{local}") if planned else tensor
                if value.is_meta:
                    raise ValueError(f"resident tensor {prefix}.{local} is on the meta device; load it first")
                self._moved.append(SavedTensor(owner, attr, kind, from_checkpoint=planned))
                if planned:
                    # The runtime tensor's layout wins (as for streamed blocks), and the copy
                    # keeps the model from aliasing the checkpoint file.
                    value = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device).copy_(
                        value
                    )
                set_tensor(owner, attr, kind, value.to(device))
                self.resident_nbytes += value.numel() * value.element_size()

    def _build_slots(
        self,
        streamed: tuple[tuple[str, nn.Module], ...],
        tensors: list[list[tuple[str, str, torch.Tensor]]],
        layouts: list[BlockLayout],
    ) -> None:
        device = self._ops.device
        world = self.world_size if self.mode == "allgather" else 1
        self.slot_nbytes = max((layout.shard_nbytes(world) * world for layout in layouts), default=0)
        ops = self._ops
        self._slots = tuple(
            _Slot(torch.zeros(self.slot_nbytes, dtype=torch.uint8, device=device), ops.new_event(), ops.new_event())
            for _ in range(2)
        )
        for slot in self._slots:
            slot.free.record(ops.current_stream())
        empty = {}
        for (name, block), block_ts, layout in zip(streamed, tensors, layouts, strict=True):
            by_name = {local: (kind, tensor) for local, kind, tensor in block_ts}
            targets, placeholders = [], []
            for entry in layout.entries:
                owner, attr = owner_of(block, entry.name)
                targets.append((owner, attr, entry))
                if entry.dtype not in empty:
                    empty[entry.dtype] = torch.empty(0, dtype=entry.dtype, device=device)
                placeholders.append(empty[entry.dtype])
            views = tuple([entry.view_in(slot.buffer) for entry in layout.entries] for slot in self._slots)
            requires_grad = any(t.requires_grad for _, t in by_name.values())
            self._streamed.append(_StreamedBlock(name, block, targets, views, placeholders, requires_grad))
            for owner, attr, entry in targets:
                self._originals.append(SavedTensor(owner, attr, entry.kind))
                set_tensor(owner, attr, entry.kind, empty[entry.dtype])

    # ------------------------------------------------------------- hot path
    def _gather_device(self) -> torch.device:
        backend = dist.get_backend(self._group)
        return self._ops.device if backend != "gloo" else torch.device("cpu")

    def _fill(self, k: int, index: int) -> None:
        """Enqueue the copy (and gather) of streamed block k into slot `index`.

        Never blocks the host, except when streaming from the checkpoint, where the
        staging buffer's previous copy must have finished before it is repacked.
        """
        slot = self._slots[index]
        if slot.state is SlotState.COMPUTING:
            raise RuntimeError(
                f"layerwise offload would overwrite slot {index} while {self._streamed[slot.tenant].name} runs "
                f"from it to load {self._streamed[k].name}; streamed blocks must not call one another"
            )
        with torch.profiler.record_function(f"dlo_offload.h2d {self._streamed[k].name}"):
            source = self._staged.stage(k, index) if self._staged is not None else self._store.buffers[k]
            shard = source.numel()
            self._transfer.wait_event(slot.free)
            with self._ops.on_stream(self._transfer):
                if self.mode == "allgather":
                    mine = slot.buffer[self.rank * shard : (self.rank + 1) * shard]
                    mine.copy_(source, non_blocking=self.pinned)
                    _all_gather_single(slot.buffer[: shard * self.world_size], mine, group=self._group)
                else:
                    slot.buffer[:shard].copy_(source, non_blocking=self.pinned)
                if self._staged is not None:
                    self._staged.done[index].record(self._transfer)
                slot.ready.record(self._transfer)
        slot.state, slot.tenant = SlotState.FILLED, k

    def _make_pre_hook(self, k: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: object) -> None:
            block = self._streamed[k]
            if block.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(
                    f"layerwise offload is inference-only but {block.name} ran with gradients enabled; "
                    "wrap the call in torch.inference_mode() (or torch.no_grad()), or call "
                    "model.requires_grad_(False) before enabling the offload"
                )
            held = [i for i, slot in enumerate(self._slots) if slot.tenant == k]
            if held:
                index = held[0]
            else:  # out-of-order call: load it now, keeping the slot the previous block used intact
                index = 1 - self._last_slot
                self._fill(k, index)
            slot = self._slots[index]
            self._ops.current_stream().wait_event(slot.ready)
            for (owner, attr, entry), view in zip(block.targets, block.slot_views[index], strict=True):
                set_tensor(owner, attr, entry.kind, view)
            slot.state = SlotState.COMPUTING
            self._last_slot = block.active_slot = index
            following = (k + 1) % len(self._streamed)
            if following != k and self._slots[1 - index].tenant != following:
                self._fill(following, 1 - index)
            forward_range = torch.profiler.record_function(f"dlo_offload.forward {block.name}")
            forward_range.__enter__()
            self._forward_ranges[k] = forward_range

        return pre_hook

    def _make_post_hook(self, k: int) -> Callable[..., None]:
        # Registered with always_call: it also runs when the forward (or the pre-hook) raised.
        def post_hook(module: nn.Module, args: object, output: object) -> None:
            forward_range = self._forward_ranges.pop(k, None)
            if forward_range is not None:
                forward_range.__exit__(None, None, None)
            block = self._streamed[k]
            for (owner, attr, entry), placeholder in zip(block.targets, block.placeholders, strict=True):
                set_tensor(owner, attr, entry.kind, placeholder)
            slot = self._slots[block.active_slot]
            if slot.state is SlotState.COMPUTING and slot.tenant == k:
                slot.free.record(self._ops.current_stream())
                slot.state = SlotState.RELEASED

        return post_hook

    # --------------------------------------------------------------- remove
    def remove(self) -> None:
        """Put the weights back: streamed blocks on the host (CPU), resident blocks and
        modules on their original device (host too when they came from the checkpoint).

        In AllGather mode this gathers each block once more, so every rank of the
        group must call it, like any collective. Calling it twice is a no-op.
        """
        if self._removed:
            return
        self._removed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._ops.synchronize()
        for k, block in enumerate(self._streamed):
            if self._slots[0].tenant != k:
                self._fill(k, 0)
            self._ops.synchronize()
            for (owner, attr, entry), view in zip(block.targets, block.slot_views[0], strict=True):
                host = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device="cpu")
                set_tensor(owner, attr, entry.kind, host.copy_(view))
            self._slots[0].free.record(self._ops.current_stream())
            self._slots[0].state = SlotState.RELEASED
        for saved in self._moved:
            if saved.from_checkpoint:  # it was never loaded before; bring it to the host like a streamed block
                saved.to_host()
        self._moved = [saved for saved in self._moved if not saved.from_checkpoint]
        self._restore_moved()
        self._streamed.clear()
        self._slots = ()
        self._store = self._staged = None
        self._close_reader()
        self._ops.empty_cache()

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _restore_moved(self) -> None:
        for saved in reversed(self._moved):
            saved.restore()
        self._moved.clear()

    def _rollback(self) -> None:
        """Undo a partial enable (exceptions inside it), restoring the original tensors."""
        self._removed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for saved in reversed(self._originals):
            saved.restore()
        self._originals.clear()
        self._restore_moved()
        self._streamed.clear()
        self._close_reader()


def enable_layerwise_offload(
    model: nn.Module,
    plan: OffloadPlan,
    *,
    device: torch.device | str | int,
    pin_memory: bool = True,
    group: dist.ProcessGroup | None = None,
    use_allgather: bool = True,
    host_weights: HostWeightPlan | None = None,
    stream_from_checkpoint: bool = False,
) -> LayerwiseOffload:
    """Stream `plan`'s blocks from the host into two device slots while the model runs.

    Args:
        model: the model; its module classes and forward are not changed.
        plan: which blocks stream, which leading blocks and modules stay resident.
        device: the compute device (``"cuda"``, ``"cuda:N"`` or ``"cpu"``; on CPU
            streams and events are no-ops and the same packing/paging path runs).
        pin_memory: pin host copies (CUDA only); a refused pin warns and falls back.
        group: the process group to shard over. With more than one rank and
            `use_allgather`, each rank keeps 1/G of every block and the block is
            rebuilt by all-gather, so every rank of it must build the same model
            with the same plan (checked: the block layouts must agree, which a
            tensor-parallel group's shards never do) and run every streamed block's
            forward together, in the same order. The caller's topology picks it.
        use_allgather: shard across `group` and rebuild by all-gather; False streams
            whole blocks from each rank's own host copy (required for resident blocks).
        host_weights: a plan from `build_checkpoint_mmap_plan`; block tensors are then
            read from the safetensors files (the module's block tensors may be meta).
        stream_from_checkpoint: rank-local mode with `host_weights` only: keep no
            private host copy; pack each block from the checkpoint's (page-cache
            shared) mapping into one of two pinned staging buffers just before its
            copy. Saves host memory when several ranks share a node, at the cost of a
            host memcpy per block per forward.

    The enable is all-or-nothing: on any error the model is left as it was.
    """
    ops = DeviceOps(device)
    handle = LayerwiseOffload()
    try:
        handle._enable(model, plan, ops, group, use_allgather, pin_memory, host_weights, stream_from_checkpoint)
    except BaseException:
        try:
            handle._rollback()
        except Exception:
            logger.exception("DLO cleanup failed while handling an enable failure")
        raise
    logger.info(
        "layerwise offload enabled (%s, %d streamed blocks, slot %.1f MiB x2, host %.1f MiB%s)",
        handle.mode,
        len(handle._streamed),
        handle.slot_nbytes / 2**20,
        handle.host_nbytes / 2**20,
        ", pinned" if handle.pinned else "",
    )
    return handle
