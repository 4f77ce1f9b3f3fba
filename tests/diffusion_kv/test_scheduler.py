"""DiffusionKVScheduler admission and lifecycle over both allocators (native = real vLLM KVCacheManager)."""

from __future__ import annotations

import pytest
from kv_builders import BLOCK_SIZE, DelegatingAllocator, EngineRequest, build_allocator, cfg_rows, pool_config

from diffusion_kv import (
    DiffusionKVCacheManager,
    DiffusionKVContext,
    DiffusionKVInvariantError,
    DiffusionKVScheduler,
    NewRequestData,
    RequestStatus,
    SchedulingPolicy,
    validate_new_request_data_identity,
)


class CountingAllocator(DelegatingAllocator):
    """Delegating wrapper: counts allocations; optionally raises (without allocating) on every call."""

    def __init__(self, inner, error: BaseException | None = None):
        super().__init__(inner)
        self.error = error

    def allocate(self, request):
        if self.error is not None:
            self.allocate_calls += 1
            raise self.error
        return super().allocate(request)


@pytest.fixture
def make_scheduler(kind):
    def make(num_blocks: int = 8, *, max_num_seqs: int = 1, max_rows: int = 4, error=None, **policy):
        config = pool_config(kind, num_blocks)
        allocator = CountingAllocator(build_allocator(kind, config, max_model_len=64), error)
        manager = DiffusionKVCacheManager(
            config,
            max_model_len=64,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            max_rows_per_request=max_rows,
            allocator=allocator,
        )
        return DiffusionKVScheduler(manager, max_num_seqs=max_num_seqs, **policy)

    return make


def _request(public_id: str, rows: int = 1, **row_fields) -> EngineRequest:
    return EngineRequest(public_id, cfg_rows(public_id, rows, prefix_len=2, **row_fields))


def _ids(envelopes):
    return [envelope.request_id for envelope in envelopes]


def _assert_baseline(scheduler: DiffusionKVScheduler) -> None:
    manager = scheduler.manager
    assert manager.get_num_free_blocks() == manager.empty_pool_num_free_blocks
    assert manager.allocator.owned_request_ids() == frozenset()
    manager.check_invariants()


def test_kv_requests_move_into_scheduler_state(make_scheduler):
    scheduler = make_scheduler(8)
    request = _request("pub", rows=2)
    kv_requests = tuple(request.diffusion_kv_requests)
    scheduler.add_request(request)
    assert request.diffusion_kv_requests is None and request.prepared_layout == "layout"
    assert scheduler.get_request_state("pub").kv_requests == kv_requests
    output = scheduler.schedule()
    (envelope,) = output.scheduled_new_reqs
    assert envelope.req is request and envelope.request_id == "pub"
    assert sum(len(s.block_ids[0]) for s in envelope.diffusion_kv_metadata.sequences) == 4


def test_capacity_backpressures_fifo_until_blocks_are_freed(make_scheduler):
    scheduler = make_scheduler(5, max_num_seqs=2)  # 4 usable blocks
    scheduler.add_request(_request("first", rows=2))  # 4 blocks
    scheduler.add_request(_request("second"))  # 2 blocks
    output = scheduler.schedule()
    assert _ids(output.scheduled_new_reqs) == ["first"]
    assert list(scheduler.waiting) == ["second"] and not scheduler.manager.has_request("second")
    scheduler.manager.check_invariants()
    assert scheduler.update_from_output(output) == set()
    assert _ids(scheduler.schedule().scheduled_new_reqs) == []  # still no space; first keeps running
    assert scheduler.update_from_output(output, completed=["first"]) == {"first"}
    output = scheduler.schedule()
    assert _ids(output.scheduled_new_reqs) == ["second"]
    assert output.finished_req_ids == {"first"}
    assert output.finished_row_targets == [("first", 1)]


def test_impossible_capacity_finishes_only_that_request(make_scheduler):
    scheduler = make_scheduler(3)  # 2 usable blocks
    scheduler.add_request(_request("impossible", rows=2))
    scheduler.add_request(_request("schedulable"))
    output = scheduler.schedule()
    assert _ids(output.scheduled_new_reqs) == ["schedulable"]
    assert output.finished_req_ids == {"impossible"}
    assert output.finished_row_targets == []  # never reserved, never installed
    state = scheduler.get_request_state("impossible")
    assert state.status is RequestStatus.FINISHED_ERROR
    assert state.error.startswith(
        "Diffusion KV request 'impossible' cannot fit even when the block pool is empty: "
        "required_blocks=4, available_blocks=2"
    )
    assert scheduler.update_from_output(output, completed=["schedulable"]) == {"impossible", "schedulable"}


def test_impossible_capacity_does_not_block_waiters_under_load(make_scheduler):
    scheduler = make_scheduler(4, max_num_seqs=2)  # 3 usable blocks
    scheduler.add_request(_request("running", seq_len=4))  # 1 block
    scheduler.schedule()
    scheduler.add_request(_request("impossible", rows=2))  # 4 blocks
    scheduler.add_request(_request("small", seq_len=8))  # 2 blocks
    output = scheduler.schedule()
    assert _ids(output.scheduled_new_reqs) == ["small"]
    assert "required_blocks=4, available_blocks=3" in scheduler.get_request_state("impossible").error


def _blocked_behind_a_big_request(make_scheduler, policy):
    """10 usable blocks, 7 held by a running request; then a big request (8 blocks) and three small ones (1 each)."""
    scheduler = make_scheduler(11, max_num_seqs=5, policy=policy, max_overtakes=2)
    scheduler.add_request(_request("holder", seq_len=28))
    scheduler.schedule()
    scheduler.add_request(_request("big", rows=2, seq_len=16))
    for name in ("s1", "s2", "s3"):
        scheduler.add_request(_request(name, seq_len=4))
    return scheduler


def test_fcfs_keeps_everything_behind_a_head_that_does_not_fit(make_scheduler):
    scheduler = _blocked_behind_a_big_request(make_scheduler, "fcfs")
    assert _ids(scheduler.schedule().scheduled_new_reqs) == []
    assert list(scheduler.waiting) == ["big", "s1", "s2", "s3"]


def test_fair_lets_fitting_requests_overtake_the_oldest_a_bounded_number_of_times(make_scheduler):
    scheduler = _blocked_behind_a_big_request(make_scheduler, "fair")
    # 3 free blocks: "big" does not fit; two small ones overtake it, the third may not.
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["s1", "s2"]
    assert not scheduler.manager.has_request("big")
    assert _ids(scheduler.schedule().scheduled_new_reqs) == []  # 1 block free, but "big" has waited long enough
    assert list(scheduler.waiting) == ["big", "s3"]
    scheduler.finish_requests("holder", RequestStatus.FINISHED_STOPPED)  # 8 free: "big" fits, nothing is left
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["big"]
    scheduler.finish_requests("s1", RequestStatus.FINISHED_STOPPED)
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["s3"]
    assert not scheduler.waiting
    for request_id in ("big", "s2", "s3"):
        scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
    _assert_baseline(scheduler)


def test_fair_fails_a_request_that_can_never_fit_at_once_even_without_a_free_slot(make_scheduler):
    scheduler = make_scheduler(5, max_num_seqs=1, policy="fair")  # 4 usable blocks, one running slot
    scheduler.add_request(_request("running"))
    scheduler.schedule()
    scheduler.add_request(_request("never-fits", rows=3))  # 6 blocks
    scheduler.add_request(_request("later"))
    output = scheduler.schedule()
    assert output.finished_req_ids == {"never-fits"} and output.num_scheduled_reqs == 1
    state = scheduler.get_request_state("never-fits")
    assert state.status is RequestStatus.FINISHED_ERROR
    assert "cannot fit even when the block pool is empty: required_blocks=6, available_blocks=4" in state.error
    assert list(scheduler.waiting) == ["later"]  # waiting for the slot, owning nothing
    assert scheduler.update_from_output(output, completed=["running"]) == {"never-fits", "running"}
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["later"]


def test_fair_aborts_a_waiting_request_like_any_other(make_scheduler):
    scheduler = make_scheduler(5, max_num_seqs=2, policy="fair")  # 4 usable blocks
    scheduler.add_request(_request("holder", rows=2))  # all 4 blocks
    scheduler.schedule()
    scheduler.add_request(_request("waiting"))
    assert scheduler.schedule().num_scheduled_reqs == 1 and list(scheduler.waiting) == ["waiting"]
    scheduler.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting and not scheduler.manager.has_request("waiting")
    output = scheduler.schedule()
    assert output.finished_req_ids == {"waiting"} and output.finished_row_targets == []
    assert scheduler.update_from_output(output) == {"waiting"}
    assert scheduler.pop_request_state("waiting").status is RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize(
    "policy,max_overtakes,match",
    [("lifo", 16, "policy must be one of 'fcfs', 'fair', got 'lifo'"), ("fair", -1, "max_overtakes must be")],
)
def test_rejects_an_unknown_policy_and_a_negative_overtake_bound(make_scheduler, policy, max_overtakes, match):
    with pytest.raises(ValueError, match=match):
        make_scheduler(8, policy=policy, max_overtakes=max_overtakes)
    assert make_scheduler(8, policy=SchedulingPolicy.FAIR).policy is SchedulingPolicy.FAIR


def test_internal_allocation_error_is_engine_fatal(make_scheduler):
    scheduler = make_scheduler(8, error=RuntimeError("native allocation bug"))
    scheduler.add_request(_request("pub"))
    with pytest.raises(DiffusionKVInvariantError) as excinfo:
        scheduler.schedule()
    assert str(excinfo.value.__cause__) == "native allocation bug"
    assert not isinstance(excinfo.value, ValueError)
    assert scheduler.get_request_state("pub").status is RequestStatus.WAITING  # not a per-request user error
    _assert_baseline(scheduler)
    with pytest.raises(DiffusionKVInvariantError, match="stopped after an invariant failure"):
        scheduler.schedule()
    scheduler.close()
    assert not scheduler.has_requests()


def test_preemption_retains_allocation_and_resumes_as_cached(make_scheduler):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub", rows=2))
    metadata = scheduler.schedule().scheduled_new_reqs[0].diffusion_kv_metadata
    free = scheduler.manager.get_num_free_blocks()
    assert scheduler.preempt_request("pub")
    assert scheduler.get_request_state("pub").status is RequestStatus.PREEMPTED
    assert scheduler.manager.get_num_free_blocks() == free
    output = scheduler.schedule()
    assert output.scheduled_new_reqs == []
    (envelope,) = output.scheduled_cached_reqs
    assert envelope.diffusion_kv_metadata == metadata
    assert scheduler.get_request_state("pub").status is RequestStatus.RUNNING
    # Running requests are re-emitted as cached on every pass.
    assert _ids(scheduler.schedule().scheduled_cached_reqs) == ["pub"]


@pytest.mark.parametrize(
    "status", [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR]
)
def test_terminal_status_releases_allocation(make_scheduler, status):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub", rows=2))
    scheduler.schedule()
    scheduler.finish_requests("pub", status)
    assert not scheduler.manager.has_request("pub")
    assert scheduler.get_request_state("pub").status is status
    _assert_baseline(scheduler)


def test_finish_requires_a_finished_status(make_scheduler):
    scheduler = make_scheduler(8)
    with pytest.raises(ValueError, match="finish_requests needs a finished status, got RUNNING"):
        scheduler.finish_requests(["x"], RequestStatus.RUNNING)


@pytest.mark.parametrize("kv_requests", [None, []])
def test_rejects_request_without_kv_requests(make_scheduler, kv_requests):
    scheduler = make_scheduler(8)
    with pytest.raises(ValueError, match="has no diffusion_kv_requests: give it one DiffusionKVRequest per CFG row"):
        scheduler.add_request(EngineRequest("pub", kv_requests))
    assert not scheduler.has_requests()


def test_request_scoped_context_moves_through_scheduler_and_is_freed(make_scheduler):
    scheduler = make_scheduler(8)
    idle = scheduler.manager.get_num_free_blocks()
    ar = DiffusionKVContext("ar", "ar_decode", 8)
    scheduler.add_request(_request("pub", contexts=(ar,)))
    output = scheduler.schedule()
    metadata = output.scheduled_new_reqs[0].diffusion_kv_metadata
    assert [(c.context_id, c.cache_role) for c in metadata.contexts] == [("ar", "ar_decode")]
    assert scheduler.manager.get_num_free_blocks() == idle - 4
    assert scheduler.update_from_output(output, completed=["pub"]) == {"pub"}
    _assert_baseline(scheduler)


def test_waiting_abort_never_allocates(make_scheduler):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub", contexts=(DiffusionKVContext("ar", "ar_decode", 4),)))
    scheduler.finish_requests(["pub"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.manager.allocator.allocate_calls == 0
    output = scheduler.schedule()
    assert output.num_scheduled_reqs == 0 and output.finished_req_ids == {"pub"}
    assert scheduler.update_from_output(output) == {"pub"}
    _assert_baseline(scheduler)


def test_running_abort_releases_before_output_update(make_scheduler):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub", contexts=(DiffusionKVContext("ar", "ar_decode", 4),)))
    output = scheduler.schedule()
    scheduler.finish_requests(["pub"], RequestStatus.FINISHED_ABORTED)
    _assert_baseline(scheduler)  # freed at once, not at the next update
    assert scheduler.update_from_output(output) == {"pub"}
    assert scheduler.get_request_state("pub").status is RequestStatus.FINISHED_ABORTED
    assert scheduler.schedule().finished_row_targets == [("pub", 1)]


def test_preempted_request_resumes_ahead_of_a_later_request(make_scheduler):
    """max_num_seqs=1 and 2 rows per request: the Worker pool has exactly 2 rows."""
    scheduler = make_scheduler(16, max_num_seqs=1, max_rows=2)
    ar = DiffusionKVContext("ar", "ar_decode", 4)
    scheduler.add_request(_request("first", contexts=(ar,)))
    first_metadata = scheduler.schedule().scheduled_new_reqs[0].diffusion_kv_metadata
    assert scheduler.preempt_request("first")
    scheduler.add_request(_request("second", contexts=(ar,)))
    output = scheduler.schedule()
    assert _ids(output.scheduled_cached_reqs) == ["first"] and output.scheduled_new_reqs == []
    assert output.scheduled_cached_reqs[0].diffusion_kv_metadata == first_metadata
    assert list(scheduler.waiting) == ["second"]
    scheduler.update_from_output(output, completed=["first"])
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["second"]


def test_installed_rows_beyond_the_worker_pool_are_an_invariant_failure(make_scheduler):
    """If the queue is ever reordered past a preempted request, schedule() fails loudly."""
    scheduler = make_scheduler(16, max_num_seqs=1, max_rows=2)
    scheduler.add_request(_request("first", rows=2))
    scheduler.schedule()
    assert scheduler.preempt_request("first")
    scheduler.add_request(_request("second", rows=2))
    scheduler.waiting.rotate(1)  # break FIFO: the new request jumps the preempted one
    with pytest.raises(DiffusionKVInvariantError, match=r"installed Worker rows \(4.*exceed the row pool of 2"):
        scheduler.schedule()


def test_backpressure_with_contexts_retries_without_partial_ownership(make_scheduler):
    scheduler = make_scheduler(6, max_num_seqs=2)  # 5 usable blocks
    scheduler.add_request(_request("holder", seq_len=8))  # 2 blocks
    scheduler.schedule()
    text = DiffusionKVContext("text", "cross.text", 8)
    scheduler.add_request(_request("ctx", rows=2, seq_len=4, contexts=(text,)))  # 1 + 1 + 2 blocks
    assert scheduler.schedule().scheduled_new_reqs == []
    assert scheduler.manager.allocator.owned_request_ids() == {"holder/diffusion-kv/0"}
    assert scheduler.manager.get_num_free_blocks() == 3
    scheduler.finish_requests(["holder"], RequestStatus.FINISHED_STOPPED)
    assert _ids(scheduler.schedule().scheduled_new_reqs) == ["ctx"]


def test_request_id_reuse_gets_new_generation_and_fresh_contexts(make_scheduler):
    scheduler = make_scheduler(8)
    text = DiffusionKVContext("text", "cross.text", 4)
    scheduler.add_request(_request("pub", contexts=(text,)))
    first = scheduler.schedule().scheduled_new_reqs[0].diffusion_kv_metadata
    with pytest.raises(ValueError, match="request_id 'pub' is already active."):
        scheduler.add_request(_request("pub"))
    scheduler.finish_requests(["pub"], RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="request_id 'pub' is already active."):
        scheduler.add_request(_request("pub"))  # finished but not popped yet
    assert scheduler.pop_request_state("pub").status is RequestStatus.FINISHED_STOPPED
    scheduler.add_request(_request("pub", contexts=(DiffusionKVContext("text", "cross.text", 8),)))
    second = scheduler.schedule().scheduled_new_reqs[0].diffusion_kv_metadata
    assert second.allocation_generation > first.allocation_generation
    assert second.contexts[0].num_tokens == 8


def test_pop_refuses_an_unfinished_request(make_scheduler):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub"))
    with pytest.raises(ValueError, match="request 'pub' is still WAITING; finish it before popping"):
        scheduler.pop_request_state("pub")


def test_preempt_refuses_unknown_and_waiting_requests(make_scheduler):
    scheduler = make_scheduler(8)
    assert not scheduler.preempt_request("nope")
    scheduler.add_request(_request("pub"))
    assert not scheduler.preempt_request("pub")


def test_completed_ids_must_come_from_the_output(make_scheduler):
    scheduler = make_scheduler(8)
    scheduler.add_request(_request("pub"))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match=r"completed requests \['other'\] were not scheduled in this output"):
        scheduler.update_from_output(output, completed=["other"])


def test_envelope_identity_is_checked():
    from diffusion_kv import DiffusionKVMetadata

    metadata = DiffusionKVMetadata(request_id="b", allocation_generation=1, sequences=())
    with pytest.raises(ValueError, match="request identity mismatch"):
        validate_new_request_data_identity(NewRequestData("a", EngineRequest("a", None), metadata))


def test_close_releases_everything(make_scheduler):
    scheduler = make_scheduler(16, max_num_seqs=2)
    scheduler.add_request(_request("a", rows=2))
    scheduler.add_request(_request("b", contexts=(DiffusionKVContext("t", "cross.text", 4),)))
    scheduler.add_request(_request("c"))
    scheduler.schedule()
    assert scheduler.has_requests()
    scheduler.close()
    assert not scheduler.has_requests()
    _assert_baseline(scheduler)
