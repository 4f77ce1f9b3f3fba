"""`CFGPairingMixin`: the scheduler behaviour that keeps CFG cond/uncond pairs step-locked.

The mixin goes in front of a scheduler class with the v1 scheduler's shape:
``waiting`` (a queue with ``remove_requests`` and ``prepend_request``),
``running``, ``requests``, ``max_num_scheduled_tokens``, ``schedule()``,
``add_request()`` and ``finish_requests()``. `cfg_pairing.CFGPairingScheduler`
and `cfg_pairing.CFGPairingAsyncScheduler` put it (plus the vLLM-only hooks of
``cfg_pairing._vllm``) in front of vLLM's ``Scheduler`` and ``AsyncScheduler``;
vLLM picks them through ``SchedulerConfig.scheduler_cls``. Tests put it in
front of a small stand-in class.

Per-scheduler state, all created in ``__init__``:

* ``_cfg_pairs``: ``pair_id -> {role: request_id}``;
* ``_cfg_req_to_pair``: ``request_id -> pair_id``; both registries always name
  the same requests;
* ``_cfg_hold_counts``: ``request_id -> schedule calls held``;
* ``_cfg_released_pairs``: pair ids released unguided (bounded), so a partner
  that arrives after its pair was given up runs as plain traffic instead of
  waiting out a fresh hold budget;
* ``_cfg_reorder_pending``: a member arrived since the wait queue was last put
  in pair order;
* ``_cfg_pairs_apart``: complete pairs the current step did not schedule
  together (handed from the pre-advance equalization to the split check).

A scheduler whose registries are empty takes the base class's code path: one
dict truthiness test per call, plus one ``extra_args`` look-up per added request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar

from cfg_pairing import pair_ids
from cfg_pairing.equalize import equalize_cfg_pair_progress

logger = logging.getLogger("cfg_pairing")

# How many released pair ids a scheduler remembers to recognise late partners.
_RELEASED_PAIR_MEMORY: int = 4096

# Waiting queues a v1 scheduler may keep, in the order it drains them.
# vLLM 0.32 has `waiting` and `kv_holding_waiting`; releases 0.24-0.31 park
# not-ready requests in `skipped_waiting`.
_WAITING_QUEUE_ATTRS: tuple[str, ...] = ("kv_holding_waiting", "skipped_waiting", "waiting")


# ---------------------------------------------------------------- registries


def _register_cfg_request(scheduler: Any, request: Any) -> None:
    role = pair_ids.cfg_role_of(request)
    if role is None:
        return
    pair_id = pair_ids.pair_id_for(request, role)
    request_id = request.request_id
    if not isinstance(pair_id, Hashable):
        logger.warning(
            "request %s has an unhashable cfg_pair_id %r; it runs unguided. Use a string pair id",
            request_id,
            pair_id,
        )
        return
    released = scheduler._cfg_released_pairs
    if pair_id in released:
        del released[pair_id]  # a release expects at most one late partner
        logger.warning(
            "CFG %s request %s arrived after pair %s was released unguided; it runs as plain traffic",
            role,
            request_id,
            pair_id,
        )
        return
    roles = scheduler._cfg_pairs.setdefault(pair_id, {})
    if roles.get(role, request_id) != request_id:
        logger.warning(
            "CFG pair %s already has a %s member (%s); %s runs unguided. Give each pair its own cfg_pair_id",
            pair_id,
            role,
            roles[role],
            request_id,
        )
        return
    roles[role] = request_id
    scheduler._cfg_req_to_pair[request_id] = pair_id
    scheduler._cfg_reorder_pending = True
    # An asymmetric prefix-cache hit would start one member ahead of the other
    # by more than equalization can take back in one step.
    if hasattr(request, "skip_reading_prefix_cache"):
        request.skip_reading_prefix_cache = True


def _forget_requests(scheduler: Any, request_ids: Iterable[str]) -> None:
    """Remove the pairs of ``request_ids`` (every member of each) from the registries."""
    hold_counts = scheduler._cfg_hold_counts
    for request_id in request_ids:
        pair_id = scheduler._cfg_req_to_pair.pop(request_id, None)
        members = scheduler._cfg_pairs.pop(pair_id, {}).values() if pair_id is not None else ()
        for member_id in (request_id, *members):
            scheduler._cfg_req_to_pair.pop(member_id, None)
            hold_counts.pop(member_id, None)


def _release_pair(scheduler: Any, pair_id: Hashable) -> None:
    """Drop a pair from the registries; its members continue as plain traffic."""
    roles = scheduler._cfg_pairs.pop(pair_id, {})
    _forget_requests(scheduler, roles.values())
    released = scheduler._cfg_released_pairs
    released[pair_id] = None
    while len(released) > _RELEASED_PAIR_MEMORY:
        released.popitem(last=False)


def _clear_registries(scheduler: Any) -> None:
    scheduler._cfg_pairs.clear()
    scheduler._cfg_req_to_pair.clear()
    scheduler._cfg_hold_counts.clear()


def _partner_ids(scheduler: Any, request_id: str) -> list[str]:
    pair_id = scheduler._cfg_req_to_pair.get(request_id)
    if pair_id is None:
        return []
    return [rid for rid in scheduler._cfg_pairs.get(pair_id, {}).values() if rid != request_id]


# ---------------------------------------------------------------- waiting queues


def _waiting_queues(scheduler: Any) -> list[Any]:
    return [queue for attr in _WAITING_QUEUE_ATTRS if (queue := getattr(scheduler, attr, None)) is not None]


def _reorder_waiting(scheduler: Any) -> None:
    """Move each pair member right behind the first of its pair in every FCFS queue.

    Priority queues order themselves; there hold + equalize keep pairs in step.
    """
    req_to_pair = scheduler._cfg_req_to_pair
    for queue in _waiting_queues(scheduler):
        if not isinstance(queue, deque) or len(queue) < 2:
            continue
        entries = list(queue)
        members_by_pair: dict[Hashable, list[Any]] = {}
        for request in entries:
            pair_id = req_to_pair.get(request.request_id)
            if pair_id is not None:
                members_by_pair.setdefault(pair_id, []).append(request)
        if not any(len(members) > 1 for members in members_by_pair.values()):
            continue
        ordered: list[Any] = []
        emitted: set[int] = set()
        for request in entries:
            if id(request) in emitted:
                continue
            pair_id = req_to_pair.get(request.request_id)
            group = members_by_pair.get(pair_id, (request,)) if pair_id is not None else (request,)
            for member in group:
                if id(member) not in emitted:
                    emitted.add(id(member))
                    ordered.append(member)
        if any(a is not b for a, b in zip(ordered, entries, strict=True)):
            queue.clear()
            queue.extend(ordered)


def _hold_incomplete_pairs(scheduler: Any, hold_counts: dict[str, int]) -> list[tuple[Any, Any]]:
    """Take members that cannot be admitted together with their partner out of the wait queues.

    A member is held while its partner has not arrived, or while the partner
    waits in a different queue (the scheduler drains those separately, so one
    could be admitted without the other). Each held call counts against
    ``max_pair_hold_steps``; past it the pair is released and the member is
    scheduled unguided in this very call. Returns ``(queue, request)`` in the
    order they were removed.
    """
    queues = _waiting_queues(scheduler)
    all_pairs_complete = len(scheduler._cfg_req_to_pair) == 2 * len(scheduler._cfg_pairs)
    if all_pairs_complete and not any(queue for queue in queues if queue is not scheduler.waiting):
        # Every pair is complete and only one queue holds requests: nobody
        # needs holding, and any leftover counter is obsolete.
        hold_counts.clear()
        return []
    req_to_pair = scheduler._cfg_req_to_pair
    members_per_queue = [[r for r in queue if r.request_id in req_to_pair] for queue in queues]
    queue_of: dict[str, int] = {
        request.request_id: index for index, members in enumerate(members_per_queue) for request in members
    }
    held: list[tuple[Any, Any]] = []
    for index, (queue, members) in enumerate(zip(queues, members_per_queue, strict=True)):
        to_hold = []
        for request in members:
            request_id = request.request_id
            pair_id = req_to_pair.get(request_id)
            if pair_id is None:  # released earlier in this loop
                continue
            roles = scheduler._cfg_pairs[pair_id]
            partners = [rid for rid in roles.values() if rid != request_id]
            complete = len(roles) == 2 and all(rid in scheduler.requests for rid in partners)
            if complete and all(queue_of.get(rid, index) == index for rid in partners):
                hold_counts.pop(request_id, None)
                continue
            count = hold_counts.get(request_id, 0) + 1
            if count > scheduler.max_pair_hold_steps:
                logger.warning(
                    "partner of %s never arrived after %d schedule steps; releasing the request unguided",
                    request_id,
                    scheduler.max_pair_hold_steps,
                )
                _release_pair(scheduler, pair_id)
                continue
            hold_counts[request_id] = count
            to_hold.append(request)
        if to_hold:
            queue.remove_requests(to_hold)
            held.extend((queue, request) for request in to_hold)
    return held


def _cap_long_prefill_threshold(scheduler: Any) -> Callable[[], None]:
    """Cap the long-prefill chunk at half the token budget for one call; returns the undo.

    With half the budget each, both members of a fresh pair fit in the step
    that admits them instead of the first one taking the whole budget.
    """
    config = getattr(scheduler, "scheduler_config", None)
    original = getattr(config, "long_prefill_token_threshold", None)
    if original is None:
        return lambda: None
    half_budget = max(1, scheduler.max_num_scheduled_tokens // 2)
    capped = half_budget if original <= 0 else min(original, half_budget)
    if capped == original:
        return lambda: None
    config.long_prefill_token_threshold = capped

    def restore() -> None:
        config.long_prefill_token_threshold = original

    return restore


# ---------------------------------------------------------------- after the step


def _past_prompt(request: Any) -> bool:
    num_prompt_tokens = getattr(request, "num_prompt_tokens", None)
    return num_prompt_tokens is None or request.num_computed_tokens >= num_prompt_tokens


def _settle_pairs(scheduler: Any, pairs_apart: list[Hashable]) -> None:
    """Release pairs that can no longer run in step, and forget finished ones.

    Only complete pairs the step did not schedule together (``pairs_apart``)
    need a look:

    * One member runs, the other does not, and the runner has reached its
      sampling position: it has sampled (or is sampling) without its partner,
      which no rollback can undo. The pair is released: the runner continues
      unguided, the other member runs as plain traffic and its output is the
      model's to discard. While the runner is still inside its prompt the pair
      is kept: once the partner is scheduled, equalization takes the lead back.
    * No member is left in ``requests``: the pair finished outside
      ``finish_requests`` (e.g. both stopped on their own); its entries go.
    """
    running_ids: set[str] | None = None
    for pair_id in pairs_apart:
        roles = scheduler._cfg_pairs.get(pair_id)
        if roles is None:
            continue
        alive = [m for rid in roles.values() if (m := scheduler.requests.get(rid)) is not None]
        if not alive:
            _forget_requests(scheduler, list(roles.values()))
            continue
        if all(member.num_computed_tokens == 0 for member in alive):
            continue  # nobody has made progress (e.g. both still waiting): nothing is split
        if running_ids is None:
            running_ids = {request.request_id for request in scheduler.running}
        runners = [m for m in alive if m.request_id in running_ids]
        if len(runners) == 1 and runners[0].num_computed_tokens > 0 and _past_prompt(runners[0]):
            logger.warning(
                "CFG pair %s split (%s); releasing cond=%s unguided, uncond=%s output is discarded",
                pair_id,
                "partner not running" if len(alive) == 2 else "partner finished",
                roles.get(pair_ids.COND_ROLE),
                roles.get(pair_ids.UNCOND_ROLE),
            )
            _release_pair(scheduler, pair_id)


# ---------------------------------------------------------------- the mixin


class CFGPairingMixin:
    """Keeps CFG pairs step-locked in the scheduler class it is mixed in front of.

    Subclasses with vLLM's post-schedule hook set ``equalizes_before_advance``
    and equalize inside ``_update_after_schedule``; others equalize the finished
    step here. Subclasses that gate KV admission override
    `_cfg_open_admission_gate` / `_cfg_close_admission_gate`.
    """

    # Schedule calls a lone member waits for its partner before it runs
    # unguided. Read at call time: deployments and tests may change it.
    max_pair_hold_steps: ClassVar[int] = 512
    equalizes_before_advance: ClassVar[bool] = False

    # Provided by the scheduler class the mixin goes in front of.
    waiting: Any
    running: list[Any]
    requests: dict[str, Any]
    max_num_scheduled_tokens: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # -- pair registries (both always name the same requests)
        self._cfg_pairs: dict[Hashable, dict[str, str]] = {}
        self._cfg_req_to_pair: dict[str, Hashable] = {}
        # -- admission
        self._cfg_hold_counts: dict[str, int] = {}
        self._cfg_released_pairs: OrderedDict[Hashable, None] = OrderedDict()
        self._cfg_reorder_pending: bool = False
        # -- handed from equalization to the split check within one schedule call
        self._cfg_pairs_apart: list[Hashable] = []

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().add_request(request, *args, **kwargs)  # type: ignore[misc]
        _register_cfg_request(self, request)
        return result

    def finish_requests(self, request_ids: Any, finished_status: Any, *args: Any, **kwargs: Any) -> Any:
        """Finish ``request_ids`` and every live partner of theirs in one call of the base method."""
        base_finish = super().finish_requests  # type: ignore[misc]
        if not self._cfg_req_to_pair:
            return base_finish(request_ids, finished_status, *args, **kwargs)
        if request_ids is None:
            result = base_finish(None, finished_status, *args, **kwargs)
            _clear_registries(self)
            return result
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for request_id in list(ids):
            ids.update(rid for rid in _partner_ids(self, request_id) if rid in self.requests)
        result = base_finish(ids, finished_status, *args, **kwargs)
        _forget_requests(self, ids)
        return result

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        base_schedule = super().schedule  # type: ignore[misc]
        if not self._cfg_pairs:
            return base_schedule(*args, **kwargs)
        if self._cfg_reorder_pending:
            # Queue order only breaks pairs apart when a member arrives.
            _reorder_waiting(self)
            self._cfg_reorder_pending = False
        held = _hold_incomplete_pairs(self, self._cfg_hold_counts)
        restore_threshold = _cap_long_prefill_threshold(self)
        self._cfg_pairs_apart = []
        self._cfg_open_admission_gate()
        try:
            output = base_schedule(*args, **kwargs)
        finally:
            self._cfg_close_admission_gate()
            restore_threshold()
            for queue, request in reversed(held):
                queue.prepend_request(request)
        if self.equalizes_before_advance:
            pairs_apart, self._cfg_pairs_apart = self._cfg_pairs_apart, []
        else:
            pairs_apart = equalize_cfg_pair_progress(self, output)
        _settle_pairs(self, pairs_apart)
        return output

    # Admission-gate hooks: no gate on a scheduler without a KV manager.
    def _cfg_open_admission_gate(self) -> None:
        """Called before the base ``schedule()`` of a call that has pairs."""

    def _cfg_close_admission_gate(self) -> None:
        """Called after the base ``schedule()`` returned or raised."""

    def _cfg_waiting_members(self) -> bool:
        """Whether a pair member sits in a wait queue."""
        req_to_pair = self._cfg_req_to_pair
        return any(request.request_id in req_to_pair for queue in _waiting_queues(self) for request in queue)
