"""The pairing patches on vLLM's real v1 ``Scheduler`` (CPU, configs built by the test).

Each test drives engine steps the way vLLM's engine core does: ``schedule()``,
a model-runner output with sampled tokens, ``update_from_output()``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the real-scheduler tests need vLLM: pip install 'cfg-pairing[cpu]'")

from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def assert_step_locked(record: Any, pairs: list[tuple[str, str]]) -> None:
    """Both members scheduled or neither, admitted in the same step, at the same position."""
    for cond_id, uncond_id in pairs:
        assert (cond_id in record.scheduled) == (uncond_id in record.scheduled), record.scheduled
        assert (cond_id in record.new_request_ids) == (uncond_id in record.new_request_ids), record.new_request_ids
        computed = record.computed_after_schedule
        if cond_id in computed and uncond_id in computed:
            assert computed[cond_id] == computed[uncond_id], (cond_id, computed)


def run_until_idle(harness: Any, scheduler: Any, pairs: list[tuple[str, str]], max_steps: int = 400) -> list[Any]:
    records = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return records
        record = harness.step(scheduler)
        assert_step_locked(record, pairs)
        records.append(record)
    raise AssertionError(f"scheduler still busy after {max_steps} steps")


def finish_step(records: list[Any], request_id: str) -> int:
    for index, record in enumerate(records):
        for engine_output in record.engine_outputs.values():
            if any(o.request_id == request_id and o.finish_reason is not None for o in engine_output.outputs):
                return index
    raise AssertionError(f"{request_id} never finished")


@pytest.mark.parametrize(("kind", "policy"), [("sync", "fcfs"), ("async", "fcfs"), ("sync", "priority")])
def test_pairs_run_step_locked_through_chunked_prefill_and_finish_together(
    vllm_harness: Any, kind: str, policy: str
) -> None:
    scheduler = vllm_harness.scheduler(kind=kind, policy=policy, max_num_batched_tokens=64)
    baseline = vllm_harness.free_blocks(scheduler)
    pairs = []
    for index, prompt_len in enumerate((100, 37, 64)):
        cond, uncond = vllm_harness.pair(f"pair-{index}", prompt_len, max_tokens=3 + index)
        pairs.append((cond.request_id, uncond.request_id))
        scheduler.add_request(cond)
        scheduler.add_request(vllm_harness.request(f"plain-{index}", [5] * (20 + index), max_tokens=5))
        scheduler.add_request(uncond)

    records = run_until_idle(vllm_harness, scheduler, pairs)

    for cond_id, uncond_id in pairs:
        assert finish_step(records, cond_id) == finish_step(records, uncond_id)
    # Chunked prefill really happened: the 100-token pair needed several steps.
    assert sum(1 for r in records if "pair-0" in r.scheduled and r.scheduled["pair-0"] > 1) >= 3
    assert vllm_harness.free_blocks(scheduler) == baseline
    assert scheduler.requests == {}
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}


def test_without_the_patches_the_same_workload_drifts_apart(vllm_harness: Any) -> None:
    # The check above can fail: vLLM alone gives the members different chunks.
    scheduler = vllm_harness.scheduler(patched=False, max_num_batched_tokens=64)
    cond, uncond = vllm_harness.pair("pair-0", 100)
    scheduler.add_request(cond)
    scheduler.add_request(vllm_harness.request("plain-0", [5] * 20))
    scheduler.add_request(uncond)

    with pytest.raises(AssertionError):
        run_until_idle(vllm_harness, scheduler, [(cond.request_id, uncond.request_id)])


def test_a_small_kv_pool_makes_the_next_pair_wait_whole(vllm_harness: Any) -> None:
    # 40-token prompts + 8 outputs = 3 blocks per request over its life; the
    # 9 usable blocks hold one pair, not two.
    scheduler = vllm_harness.scheduler(num_blocks=10)
    baseline = vllm_harness.free_blocks(scheduler)
    first, second = vllm_harness.pair("first", 40, max_tokens=8), vllm_harness.pair("second", 40, max_tokens=8)
    for request in (*first, *second):
        scheduler.add_request(request)
    pairs = [(first[0].request_id, first[1].request_id), (second[0].request_id, second[1].request_id)]

    records = run_until_idle(vllm_harness, scheduler, pairs)

    admitted = {rid: i for i, r in enumerate(records) for rid in r.new_request_ids}
    assert admitted["second"] == admitted["second__cfg_uncond"] > admitted["first"]
    assert all("second" not in r.scheduled for r in records[: finish_step(records, "first")])
    assert scheduler.kv_cache_manager.pair_gate is None  # the gate lives for one call only
    assert vllm_harness.free_blocks(scheduler) == baseline
    assert scheduler._cfg_pairs == {}


def test_without_the_patches_a_small_pool_splits_the_next_pair(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler(patched=False, num_blocks=10)
    for request in (*vllm_harness.pair("first", 40, max_tokens=8), *vllm_harness.pair("second", 40, max_tokens=8)):
        scheduler.add_request(request)

    records = [vllm_harness.step(scheduler) for _ in range(3)]

    assert any("second" in r.scheduled and "second__cfg_uncond" not in r.scheduled for r in records)


def test_aborting_one_member_finishes_both_and_frees_their_blocks(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler()
    baseline = vllm_harness.free_blocks(scheduler)
    cond, uncond = vllm_harness.pair("req-1", 40, max_tokens=50)
    plain = vllm_harness.request("plain", [5] * 30, max_tokens=50)
    for request in (cond, uncond, plain):
        scheduler.add_request(request)
    for _ in range(4):
        vllm_harness.step(scheduler)
    assert cond.num_output_tokens == uncond.num_output_tokens == 4

    finished = scheduler.finish_requests("req-1__cfg_uncond", RequestStatus.FINISHED_ABORTED)

    assert {r.request_id for r in finished} == {"req-1", "req-1__cfg_uncond"}
    assert cond.status == uncond.status == RequestStatus.FINISHED_ABORTED
    assert set(scheduler.requests) == {"plain"}
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}
    record = vllm_harness.step(scheduler)
    assert record.scheduled == {"plain": 1}
    scheduler.finish_requests("plain", RequestStatus.FINISHED_ABORTED)
    assert vllm_harness.free_blocks(scheduler) == baseline


def test_a_member_that_stops_on_its_own_takes_its_partner_along(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler()
    baseline = vllm_harness.free_blocks(scheduler)
    cond, uncond = vllm_harness.pair("req-1", 20, max_tokens=50, stop_token_ids=[99])
    scheduler.add_request(cond)
    scheduler.add_request(uncond)
    vllm_harness.step(scheduler)
    vllm_harness.step(scheduler)

    record = vllm_harness.step(scheduler, token_for=lambda rid: 99 if rid == "req-1" else 7)

    reasons = {o.request_id: o.finish_reason for eo in record.engine_outputs.values() for o in eo.outputs}
    assert reasons == {"req-1": FinishReason.STOP, "req-1__cfg_uncond": FinishReason.ABORT}
    assert scheduler.requests == {} and scheduler.running == []
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}
    assert vllm_harness.free_blocks(scheduler) == baseline


def test_a_prefix_cache_hit_does_not_start_one_member_ahead(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler()
    cond, uncond = vllm_harness.pair("req-1", 64)
    warm = vllm_harness.request("warm", list(cond.prompt_token_ids), max_tokens=1)
    scheduler.add_request(warm)
    run_until_idle(vllm_harness, scheduler, [])

    scheduler.add_request(cond)
    scheduler.add_request(uncond)
    record = vllm_harness.step(scheduler)

    assert record.scheduled == {"req-1": 64, "req-1__cfg_uncond": 64}
    # Sanity: the cache really holds the cond prompt, so a plain twin would hit it.
    plain_twin = vllm_harness.request("twin", list(cond.prompt_token_ids))
    assert scheduler.kv_cache_manager.get_computed_blocks(plain_twin)[1] == 48


def test_a_lone_member_waits_for_its_partner_then_runs_unguided(
    vllm_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = vllm_harness.scheduler()
    monkeypatch.setattr(type(scheduler), "max_pair_hold_steps", 3)
    baseline = vllm_harness.free_blocks(scheduler)
    cond, _ = vllm_harness.pair("req-1", 20, max_tokens=2)
    scheduler.add_request(cond)
    scheduler.add_request(vllm_harness.request("plain", [5] * 20, max_tokens=2))

    held = [vllm_harness.step(scheduler) for _ in range(3)]

    assert [r.scheduled.get("req-1") for r in held] == [None, None, None]
    assert "plain" in held[0].scheduled
    assert [r.request_id for r in scheduler.waiting] == ["req-1"]
    record = vllm_harness.step(scheduler)
    assert record.scheduled == {"req-1": 20}
    assert scheduler._cfg_pairs == {}
    run_until_idle(vllm_harness, scheduler, [])
    assert vllm_harness.free_blocks(scheduler) == baseline


def test_plain_traffic_is_scheduled_exactly_as_without_the_patches(vllm_harness: Any) -> None:
    def run(patched: bool) -> tuple[list[dict[str, int]], Any]:
        scheduler = vllm_harness.scheduler(patched=patched, num_blocks=24, max_num_batched_tokens=48)
        for index in range(6):
            scheduler.add_request(
                vllm_harness.request(
                    f"plain-{index}",
                    [5 + index] * (30 + 7 * index),
                    max_tokens=6,
                    extra_args={"seed": index} if index % 2 else None,
                )
            )
        schedule = []
        while scheduler.has_unfinished_requests():
            schedule.append(vllm_harness.step(scheduler).scheduled)
        return schedule, scheduler

    unpatched, _ = run(patched=False)
    patched, scheduler = run(patched=True)

    assert patched == unpatched
    assert len(unpatched) > 10
    assert scheduler._cfg_hold_counts == {} and scheduler._cfg_released_pairs == {}
    assert scheduler.kv_cache_manager.pair_gate is None
    assert scheduler.scheduler_config.long_prefill_token_threshold == 0


def test_a_pair_never_takes_the_last_running_slot_alone(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler(max_num_seqs=2)
    scheduler.add_request(vllm_harness.request("plain", [5] * 20, max_tokens=4))
    for request in vllm_harness.pair("req-1", 20, max_tokens=4):
        scheduler.add_request(request)

    records = run_until_idle(vllm_harness, scheduler, [("req-1", "req-1__cfg_uncond")])

    admitted = {rid: i for i, r in enumerate(records) for rid in r.new_request_ids}
    assert admitted["req-1"] == admitted["req-1__cfg_uncond"] > finish_step(records, "plain")


def test_without_the_patches_the_last_slot_splits_the_pair(vllm_harness: Any) -> None:
    scheduler = vllm_harness.scheduler(patched=False, max_num_seqs=2)
    scheduler.add_request(vllm_harness.request("plain", [5] * 20, max_tokens=4))
    for request in vllm_harness.pair("req-1", 20, max_tokens=4):
        scheduler.add_request(request)

    record = vllm_harness.step(scheduler)

    assert "req-1" in record.scheduled and "req-1__cfg_uncond" not in record.scheduled


def test_a_preemption_that_splits_a_decoding_pair_releases_it_cleanly(
    vllm_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # 9 usable blocks: three 30-token prompts fit (2 blocks each), but all three
    # cannot grow past 48 tokens, so vLLM preempts the last running request (the
    # uncond member) mid-decode. No rollback can re-sync a member that already
    # sampled alone, so the pair is released: cond continues unguided.
    scheduler = vllm_harness.scheduler(num_blocks=10)
    baseline = vllm_harness.free_blocks(scheduler)
    scheduler.add_request(vllm_harness.request("plain", [9] * 30, max_tokens=40))
    cond, uncond = vllm_harness.pair("req-1", 30, max_tokens=40)
    scheduler.add_request(cond)
    scheduler.add_request(uncond)

    with caplog.at_level("WARNING", logger="cfg_pairing"):
        run_until_idle(vllm_harness, scheduler, [])

    assert uncond.num_preemptions >= 1
    assert any("CFG pair req-1 split" in message for message in caplog.messages)
    assert cond.num_output_tokens == uncond.num_output_tokens == 40
    assert vllm_harness.free_blocks(scheduler) == baseline
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}


def first_token_step(records: list[Any], request_id: str) -> int:
    for index, record in enumerate(records):
        for engine_output in record.engine_outputs.values():
            if any(o.request_id == request_id and o.new_token_ids for o in engine_output.outputs):
                return index
    raise AssertionError(f"{request_id} never produced a token")


def test_a_pair_split_by_the_token_budget_catches_up_before_it_samples(vllm_harness: Any) -> None:
    # Step 1 gives a long plain prefill the whole 64-token budget. When the pair
    # arrives, chunks are capped at 32: the plain request takes 32 and the cond
    # member the other 32, so the uncond member is admitted one step later.
    # Trimming the cond member to one token lets its partner catch up before
    # either reaches its sampling position.
    scheduler = vllm_harness.scheduler(max_num_batched_tokens=64)
    scheduler.add_request(vllm_harness.request("plain", [5] * 100, max_tokens=3))
    vllm_harness.step(scheduler)
    cond, uncond = vllm_harness.pair("req-1", 40, max_tokens=5)
    scheduler.add_request(cond)
    scheduler.add_request(uncond)

    records = run_until_idle(vllm_harness, scheduler, [])

    assert records[0].scheduled.get("req-1") and "req-1__cfg_uncond" not in records[0].scheduled
    assert first_token_step(records, "req-1") == first_token_step(records, "req-1__cfg_uncond")
    assert finish_step(records, "req-1") == finish_step(records, "req-1__cfg_uncond")
    locked_from = first_token_step(records, "req-1")
    for record in records[locked_from:]:
        assert_step_locked(record, [("req-1", "req-1__cfg_uncond")])


def test_without_the_patches_a_budget_split_pair_samples_apart(vllm_harness: Any) -> None:
    # The same 32-token chunks, configured this time, without the patches.
    scheduler = vllm_harness.scheduler(patched=False, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    scheduler.add_request(vllm_harness.request("plain", [5] * 100, max_tokens=3))
    vllm_harness.step(scheduler)
    for request in vllm_harness.pair("req-1", 40, max_tokens=5):
        scheduler.add_request(request)

    records = run_until_idle(vllm_harness, scheduler, [])

    assert first_token_step(records, "req-1") != first_token_step(records, "req-1__cfg_uncond")


def test_blocks_a_trimmed_member_has_not_computed_are_not_served_from_the_prefix_cache(vllm_harness: Any) -> None:
    # The budget runs out right after the cond member's 32-token chunk, so the
    # chunk is cut to one token. vLLM had already committed the chunk's two
    # full blocks to the prefix cache at allocation.
    scheduler = vllm_harness.scheduler(max_num_batched_tokens=64)
    scheduler.add_request(vllm_harness.request("plain", [5] * 100, max_tokens=1))
    vllm_harness.step(scheduler)
    cond, uncond = vllm_harness.pair("req-1", 64, max_tokens=2)
    scheduler.add_request(cond)
    scheduler.add_request(uncond)

    record = vllm_harness.step(scheduler)

    assert record.scheduled["req-1"] == 1 and "req-1__cfg_uncond" not in record.scheduled
    twin = vllm_harness.request("twin", list(cond.prompt_token_ids))
    assert scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 0
    run_until_idle(vllm_harness, scheduler, [])
    # Once computed, the prompt's blocks are committed again and serve a twin.
    assert scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 48
