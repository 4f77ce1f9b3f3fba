"""Progress equalization: after a schedule step both members of a pair stand at
the same ``num_computed_tokens``.

The scheduler can give the two members different token counts in one step (a
token budget that runs out between them, different prompt lengths, a member
that was admitted a step late). Equalization claws the lead back by scheduling
fewer tokens for the member that is ahead:

* ``target = min(cond_after, uncond_after)`` where ``*_after`` is the member's
  computed-token count once this step's tokens are counted;
* feasible only if every member keeps at least one scheduled token
  (``after - target < scheduled``), because a scheduler output cannot express a
  scheduled request with zero tokens; an infeasible rollback changes nothing
  and is left to a later step (or to the split-pair release);
* a feasible rollback lowers the member's scheduled tokens and the output's
  total by the same amount. KV blocks allocated for the dropped tokens stay
  with the request and are consumed by its next step, so nothing leaks.

Two entry points share that rule:

* `equalize_cfg_pair_progress` works on a finished step, where
  ``num_computed_tokens`` already includes the step's tokens (the order a
  scheduler without a post-schedule hook leaves things in);
* `equalize_before_advance` works on vLLM's output *before*
  ``_update_after_schedule`` advances the counters, so vLLM's own bookkeeping
  (in-flight tokens, prefill-chunk flags, async output placeholders) sees the
  trimmed counts and stays consistent. Where the full rollback is infeasible
  it still trims the member ahead to one token (see its docstring).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


def plan_rollback(
    cond_after: int, uncond_after: int, cond_scheduled: int, uncond_scheduled: int
) -> tuple[int, int] | None:
    """Tokens to take back from (cond, uncond) so both end at the same position.

    Returns ``None`` when there is nothing to do: a member is not scheduled,
    the pair is already aligned, or the rollback would leave a member with no
    scheduled token.
    """
    if cond_scheduled <= 0 or uncond_scheduled <= 0 or cond_after == uncond_after:
        return None
    target = min(cond_after, uncond_after)
    cond_back, uncond_back = cond_after - target, uncond_after - target
    if cond_back >= cond_scheduled or uncond_back >= uncond_scheduled:
        return None
    return cond_back, uncond_back


def _split_by_schedule(
    scheduler: Any, scheduled: dict[str, int]
) -> tuple[list[tuple[Any, int, Any, int]], list[Hashable], list[Any]]:
    """Sort complete pairs by whether the step scheduled both members.

    Returns ``(together, apart, lone)``: ``(cond, cond_scheduled, uncond,
    uncond_scheduled)`` for pairs with both members scheduled; the ids of the
    other complete pairs; and the members scheduled without their partner.
    """
    requests = scheduler.requests
    together, apart, lone = [], [], []
    for pair_id, roles in scheduler._cfg_pairs.items():
        cond_id, uncond_id = roles.get("cond"), roles.get("uncond")
        if cond_id is None or uncond_id is None:
            continue
        cond_scheduled, uncond_scheduled = scheduled.get(cond_id, 0), scheduled.get(uncond_id, 0)
        if cond_scheduled and uncond_scheduled:
            together.append((requests[cond_id], cond_scheduled, requests[uncond_id], uncond_scheduled))
            continue
        apart.append(pair_id)
        if cond_scheduled or uncond_scheduled:
            lone.append(requests[cond_id if cond_scheduled else uncond_id])
    return together, apart, lone


def _take_back(scheduler_output: Any, request_id: str, tokens: int) -> None:
    scheduler_output.num_scheduled_tokens[request_id] -= tokens
    scheduler_output.total_num_scheduled_tokens -= tokens


def _has_speculative_tokens(scheduler_output: Any, request_id: str) -> bool:
    # Draft tokens sit at the end of a request's scheduled range; trimming the
    # range would cut them off without telling the worker, so such pairs are
    # left alone.
    spec_tokens = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    return bool(spec_tokens and spec_tokens.get(request_id))


def equalize_cfg_pair_progress(scheduler: Any, scheduler_output: Any) -> list[Hashable]:
    """Equalize every complete pair after a step whose tokens are already counted.

    Needs ``scheduler._cfg_pairs`` and ``scheduler.requests``; mutates the
    members' ``num_computed_tokens`` and the output's token counts. Returns the
    ids of complete pairs the step did not schedule together.
    """
    together, apart, _ = _split_by_schedule(scheduler, scheduler_output.num_scheduled_tokens)
    for cond, cond_scheduled, uncond, uncond_scheduled in together:
        plan = plan_rollback(cond.num_computed_tokens, uncond.num_computed_tokens, cond_scheduled, uncond_scheduled)
        if plan is None:
            continue
        for request, back in zip((cond, uncond), plan, strict=True):
            if back:
                request.num_computed_tokens -= back
                _take_back(scheduler_output, request.request_id, back)
    return apart


def equalize_before_advance(scheduler: Any, scheduler_output: Any) -> tuple[list[Hashable], list[tuple[Any, int]]]:
    """Equalize every complete pair before the step's tokens are counted.

    Only the output changes; the caller then lets the scheduler advance each
    request by its (trimmed) scheduled count. Returns the ids of complete pairs
    the step did not schedule together, and ``(request, position)`` for every
    request whose scheduled range was cut, ``position`` being where its
    computation now ends after this step.

    Two catch-up rules go further than the rollback rule, because a member
    that reaches its sampling position ahead of its partner can never be
    re-synced: where the full rollback is infeasible, the member ahead is
    trimmed to one token (its lead shrinks as far as one step allows); and a
    member scheduled while its partner is not (the token budget or the last
    running slot ran out between them, or the partner was preempted) is
    trimmed to one token, so the partner starts at most one token behind.
    """
    together, apart, lone = _split_by_schedule(scheduler, scheduler_output.num_scheduled_tokens)
    trimmed: list[Any] = []
    for cond, cond_scheduled, uncond, uncond_scheduled in together:
        cond_after = cond.num_computed_tokens + cond_scheduled
        uncond_after = uncond.num_computed_tokens + uncond_scheduled
        if cond_after == uncond_after:
            continue
        if _has_speculative_tokens(scheduler_output, cond.request_id) or _has_speculative_tokens(
            scheduler_output, uncond.request_id
        ):
            continue
        plan = plan_rollback(cond_after, uncond_after, cond_scheduled, uncond_scheduled)
        if plan is None:
            ahead, ahead_scheduled = (cond, cond_scheduled) if cond_after > uncond_after else (uncond, uncond_scheduled)
            plan = (ahead_scheduled - 1, 0) if ahead is cond else (0, ahead_scheduled - 1)
        for request, back in zip((cond, uncond), plan, strict=True):
            if back:
                _take_back(scheduler_output, request.request_id, back)
                trimmed.append(request)
    # A member scheduled without its partner (the budget, the last running slot
    # or a preemption kept the partner out) moves one token only, so the
    # partner can catch up before either reaches its sampling position.
    scheduled = scheduler_output.num_scheduled_tokens
    for request in lone:
        lone_scheduled = scheduled[request.request_id]
        if lone_scheduled > 1 and not _has_speculative_tokens(scheduler_output, request.request_id):
            _take_back(scheduler_output, request.request_id, lone_scheduled - 1)
            trimmed.append(request)
    return apart, [(request, request.num_computed_tokens + scheduled[request.request_id]) for request in trimmed]
