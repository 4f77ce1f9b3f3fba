"""Random reserve / finish / abort / preempt / resume / reuse sequences over small pools, under both policies.

After every step no partial ownership exists (the manager's tables, the
allocator's ownership and the block count agree, and only running or
preempted requests own blocks); at the end the pool is back to its baseline.
Runs against both allocators; the native one is a real vLLM KVCacheManager.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_builders import BLOCK_SIZE, EngineRequest, cfg_rows, pool_config

from diffusion_kv import (
    DiffusionKVCacheManager,
    DiffusionKVContext,
    DiffusionKVScheduler,
    RequestStatus,
)

PUBLIC_IDS = ("a", "b", "c")


class ReservationMachine(RuleBasedStateMachine):
    allocator_kind = "builtin"

    @initialize(
        num_blocks=st.integers(3, 10),
        max_num_seqs=st.integers(1, 3),
        max_rows=st.integers(1, 3),
        policy=st.sampled_from(["fcfs", "fair"]),
        max_overtakes=st.integers(0, 3),
    )
    def build(self, num_blocks, max_num_seqs, max_rows, policy, max_overtakes):
        config = pool_config(self.allocator_kind, num_blocks, num_kv_heads=1, dtype=torch.float16)
        self.manager = DiffusionKVCacheManager(
            config,
            max_model_len=32,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            max_rows_per_request=max_rows,
            allocator=self.allocator_kind,
        )
        self.scheduler = DiffusionKVScheduler(
            self.manager, max_num_seqs=max_num_seqs, policy=policy, max_overtakes=max_overtakes
        )
        self.baseline = self.manager.get_num_free_blocks()
        self.last_output = None
        self.max_generation = 0

    def _states(self, *statuses):
        return sorted(
            request_id
            for request_id in PUBLIC_IDS
            if request_id in self.scheduler._states and self.scheduler._states[request_id].status in statuses
        )

    @rule(
        public_id=st.sampled_from(PUBLIC_IDS),
        rows=st.integers(1, 3),
        seq_len=st.integers(1, 12),
        context_tokens=st.one_of(st.none(), st.integers(1, 8)),
    )
    def add(self, public_id, rows, seq_len, context_tokens):
        contexts = () if context_tokens is None else (DiffusionKVContext("ctx", "cross.text", context_tokens),)
        kv = cfg_rows(public_id, rows, prefix_len=0, seq_len=seq_len, contexts=contexts)
        if public_id in self.scheduler._states:
            with pytest.raises(ValueError, match="is already active"):
                self.scheduler.add_request(EngineRequest(public_id, kv))
        else:
            self.scheduler.add_request(EngineRequest(public_id, kv))

    @rule()
    def schedule(self):
        output = self.scheduler.schedule()
        for envelope in output.scheduled_new_reqs:  # fresh reservations: generations only ever grow
            generation = envelope.diffusion_kv_metadata.allocation_generation
            assert generation > self.max_generation
            self.max_generation = generation
        self.last_output = output

    @precondition(lambda self: self.last_output is not None)
    @rule(data=st.data())
    def complete(self, data):
        scheduled = [e.request_id for e in self.last_output.scheduled_new_reqs + self.last_output.scheduled_cached_reqs]
        running = [r for r in scheduled if r in self.scheduler.running]
        done = data.draw(st.lists(st.sampled_from(running), unique=True)) if running else []
        finished = self.scheduler.update_from_output(self.last_output, completed=done)
        assert set(done) <= finished
        self.last_output = None

    @rule(public_id=st.sampled_from(PUBLIC_IDS))
    def abort(self, public_id):
        self.scheduler.finish_requests([public_id], RequestStatus.FINISHED_ABORTED)
        if public_id in self.scheduler._states:
            assert not self.manager.has_request(public_id)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(data=st.data())
    def preempt_running(self, data):
        public_id = data.draw(st.sampled_from(sorted(self.scheduler.running)))
        free = self.manager.get_num_free_blocks()
        assert self.scheduler.preempt_request(public_id)
        assert self.manager.get_num_free_blocks() == free

    @rule(public_id=st.sampled_from(PUBLIC_IDS))
    def preempt_not_running_is_refused(self, public_id):
        if public_id not in self.scheduler.running:
            assert not self.scheduler.preempt_request(public_id)

    @rule(public_id=st.sampled_from(PUBLIC_IDS))
    def pop_finished(self, public_id):
        state = self.scheduler._states.get(public_id)
        if state is not None and state.is_finished:
            self.scheduler.pop_request_state(public_id)

    @invariant()
    def no_partial_ownership(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        owners = set(self.manager._metadata)
        installed = set(self._states(RequestStatus.RUNNING, RequestStatus.PREEMPTED))
        # Exactly the installed (running or preempted) requests own blocks.
        assert owners == installed
        assert len(self.scheduler.running) <= self.scheduler.max_num_running_reqs
        rows = sum(self.manager.get_metadata(r).num_rows for r in installed)
        assert rows <= self.scheduler.worker_row_pool_size
        preempted = self._states(RequestStatus.PREEMPTED)
        assert list(self.scheduler.waiting)[: len(preempted)] == sorted(
            preempted, key=list(self.scheduler.waiting).index
        )

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        self.scheduler.finish_requests(PUBLIC_IDS, RequestStatus.FINISHED_ABORTED)
        assert self.manager.get_num_free_blocks() == self.baseline
        assert self.manager.allocator.owned_request_ids() == frozenset()
        self.scheduler.close()
        assert not self.scheduler.has_requests()


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


class BuiltinReservationMachine(ReservationMachine):
    allocator_kind = "builtin"


TestBuiltinReservations = BuiltinReservationMachine.TestCase
TestBuiltinReservations.settings = _settings(150)


class NativeReservationMachine(ReservationMachine):
    allocator_kind = "native"


try:
    import vllm.v1.core.kv_cache_manager  # noqa: F401
except ImportError:
    _HAVE_VLLM = False
else:
    _HAVE_VLLM = True

TestNativeReservations = pytest.mark.skipif(not _HAVE_VLLM, reason="vLLM is not installed")(
    NativeReservationMachine.TestCase
)
TestNativeReservations.settings = _settings(60)
