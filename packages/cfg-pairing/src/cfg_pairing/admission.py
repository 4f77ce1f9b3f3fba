"""Pair-aware KV admission: the first member of a waiting pair is admitted only
if the pool can also take its partner's first chunk in the same step.

vLLM admits waiting requests one at a time; with a nearly full pool the cond
member can get its blocks and the uncond member, one queue slot later, not.
That splits the pair for good (the cond row runs and samples alone). The gate
closes that gap through ``allocate_slots(reserved_blocks=...)``, vLLM's own
"leave this many blocks free for others" knob: when the first member of a pair
asks for blocks, the partner's first-chunk need is added to the reservation, so
either both fit or the first one waits (and the scheduler's FCFS scan stops
there, exactly as for any request that does not fit).

Invariants:
* only waiting/preempted members whose partner is also still waiting are
  affected; running members growing their KV and plain requests pass straight
  through;
* the gate is in place only during schedule calls in which a pair member
  waits in a queue;
* the reservation is an upper bound of what the partner will ask for this step
  (its first chunk, capped like the scheduler caps it), so a pair admitted by
  the gate never splits on KV;
* the gate never stalls the queue for good: a pair whose two first chunks could
  not fit even an empty pool is left to vLLM's own order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ADMITTABLE_STATUS_NAMES = ("WAITING", "PREEMPTED")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _partner_first_chunk_blocks(scheduler: Any, partner: Any) -> int:
    """Blocks the partner needs for the chunk it would get in this step."""
    remaining = partner.num_tokens - partner.num_computed_tokens
    chunk = min(remaining, scheduler.max_num_scheduled_tokens)
    threshold = scheduler.scheduler_config.long_prefill_token_threshold
    if threshold > 0:
        chunk = min(chunk, threshold)
    tokens = partner.num_computed_tokens + chunk + scheduler.num_lookahead_tokens
    return sum(
        _ceil_div(tokens, group.kv_cache_spec.block_size)
        for group in scheduler.kv_cache_config.kv_cache_groups
    )


def partner_reservation(scheduler: Any, request: Any, admittable: frozenset[Any]) -> int | None:
    """Extra blocks to keep free while ``request`` is admitted; ``None`` = do not admit it now.

    ``admittable`` holds the statuses of a request being admitted from a wait
    queue. ``None`` means the step has no running slot left for the partner, so
    admitting this member alone would split the pair.
    """
    pair_id = scheduler._cfg_req_to_pair.get(request.request_id)
    if pair_id is None:
        return 0
    partner_ids = [rid for rid in scheduler._cfg_pairs.get(pair_id, {}).values() if rid != request.request_id]
    if not partner_ids:
        return 0
    partner = scheduler.requests.get(partner_ids[0])
    if partner is None or partner.status not in admittable:
        return 0
    num_active = len(scheduler.running) + getattr(scheduler, "num_waiting_for_streaming_input", 0)
    max_active = getattr(scheduler, "max_num_active_reqs", None) or scheduler.max_num_running_reqs
    if num_active + 2 > max_active:
        return None
    reservation = _partner_first_chunk_blocks(scheduler, partner)
    usable_blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # one is vLLM's null block
    if 2 * reservation > usable_blocks:
        # Two such chunks never fit side by side, not even in an empty pool:
        # gating would stall the queue behind this pair for good.
        return 0
    return reservation


# Called by vLLM's scheduler for each request its waiting scan looks at, after
# every running request has been given its blocks.
_WAITING_SCAN_HOOK = "_handle_blocked_waiting_request"


def gate_pair_admissions(scheduler: Any, status_enum: type) -> Callable[[], None]:
    """Put the pair gate on ``allocate_slots`` for one schedule call's waiting scan; returns the undo.

    Meant for a schedule call in which a pair member waits for admission
    (``status_enum`` is the requests' status enum, which names the waiting
    statuses); calls without one keep vLLM's allocation path untouched. The gate
    goes on when the scan reaches its first waiting request, so the running
    requests' allocations before it pay nothing; a scheduler without that hook
    gets the gate for the whole call.
    """
    undo_gate: list[Callable[[], None]] = []
    if not hasattr(type(scheduler), _WAITING_SCAN_HOOK):
        undo_gate.append(_install_gate(scheduler, status_enum))
    else:
        scan_hook = getattr(scheduler, _WAITING_SCAN_HOOK)

        def first_waiting_request(request: Any) -> Any:
            delattr(scheduler, _WAITING_SCAN_HOOK)
            undo_gate.append(_install_gate(scheduler, status_enum))
            return scan_hook(request)

        setattr(scheduler, _WAITING_SCAN_HOOK, first_waiting_request)

    def undo() -> None:
        if _WAITING_SCAN_HOOK in vars(scheduler):
            delattr(scheduler, _WAITING_SCAN_HOOK)
        for undo_one in undo_gate:
            undo_one()

    return undo


def _install_gate(scheduler: Any, status_enum: type) -> Callable[[], None]:
    """Route ``scheduler.kv_cache_manager.allocate_slots`` through the pair gate; returns the undo."""
    admittable = frozenset(status_enum[name] for name in _ADMITTABLE_STATUS_NAMES)
    # Identity tests: hashing an enum member runs Python code, and this runs
    # for every allocation in the step.
    waiting_status, preempted_status = (status_enum[name] for name in _ADMITTABLE_STATUS_NAMES)
    req_to_pair = scheduler._cfg_req_to_pair
    manager = scheduler.kv_cache_manager
    previous = vars(manager).get("allocate_slots")
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        status = request.status
        if (status is waiting_status or status is preempted_status) and request.request_id in req_to_pair:
            reservation = partner_reservation(scheduler, request, admittable)
            if reservation is None:
                return None
            if reservation:
                kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + reservation
        return allocate(request, num_new_tokens, *args, **kwargs)

    manager.allocate_slots = allocate_slots

    def undo() -> None:
        if previous is None:
            del manager.allocate_slots
        else:
            manager.allocate_slots = previous

    return undo
