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
* the gate is open only during the waiting scan of schedule calls in which a
  pair member waits in a queue (`cfg_pairing.CFGPairingScheduler` opens it);
* the reservation is an upper bound of what the partner will ask for this step
  (its first chunk, capped like the scheduler caps it), so a pair admitted by
  the gate never splits on KV;
* the gate never stalls the queue for good: a pair whose two first chunks could
  not fit even an empty pool is left to vLLM's own order.
"""

from __future__ import annotations

from typing import Any


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
    return sum(_ceil_div(tokens, group.kv_cache_spec.block_size) for group in scheduler.kv_cache_config.kv_cache_groups)


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
