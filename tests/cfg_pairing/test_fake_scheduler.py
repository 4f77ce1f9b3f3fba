"""The pairing patches on a small stand-in scheduler with the v1 scheduler's shape.

These pin the algorithm (pair ids, holding, reordering, equalization,
finish-together, plain traffic) with exact expectations; the real vLLM
``Scheduler`` is exercised in ``test_vllm_scheduler.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from cfg_pairing import (
    CFGPairingMixin,
    cfg_uncond_suffixes,
    equalize_cfg_pair_progress,
    pair_ids,
    register_cfg_uncond_suffix,
)


def paired(cls: type) -> type:
    """The stand-in class with the pairing mixin in front, as vLLM's classes get it."""
    return type(f"Paired{cls.__name__}", (CFGPairingMixin, cls), {})


class StubRequest:
    """The parts of ``vllm.v1.request.Request`` the patches read (identity equality)."""

    def __init__(self, request_id: str, extra_args: dict[str, Any] | None = None, tokens_per_step: int = 1) -> None:
        self.request_id = request_id
        self.sampling_params = SimpleNamespace(extra_args=extra_args)
        self.num_computed_tokens = 0
        self.tokens_per_step = tokens_per_step
        self.skip_reading_prefix_cache = False


class FCFSQueue(deque):
    def remove_requests(self, requests: list[StubRequest]) -> None:
        kept = [r for r in self if not any(r is gone for gone in requests)]
        self.clear()
        self.extend(kept)

    def prepend_request(self, request: StubRequest) -> None:
        self.appendleft(request)


@dataclass
class StepOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0


def make_scheduler_class(with_skipped_queue: bool = False) -> type:
    """A fresh class per test so patches never stack across tests."""

    class StubScheduler:
        def __init__(self) -> None:
            self.waiting = FCFSQueue()
            if with_skipped_queue:
                self.skipped_waiting = FCFSQueue()
            self.running: list[StubRequest] = []
            self.requests: dict[str, StubRequest] = {}
            self.finish_calls: list[tuple[set[str], str]] = []
            self.seen_waiting: list[list[str]] = []
            self.seen_thresholds: list[int] = []
            self.max_num_scheduled_tokens = 512
            self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=4096)
            self.fail_next_schedule = False

        def add_request(self, request: StubRequest) -> None:
            self.requests[request.request_id] = request
            self.waiting.append(request)

        def finish_requests(self, request_ids: Any, finished_status: str) -> None:
            if request_ids is None:
                ids = set(self.requests)
            elif isinstance(request_ids, str):
                ids = {request_ids}
            else:
                ids = set(request_ids)
            self.finish_calls.append((ids, finished_status))
            self.running = [r for r in self.running if r.request_id not in ids]
            for request_id in ids:
                self.requests.pop(request_id, None)

        def schedule(self) -> StepOutput:
            self.seen_waiting.append([r.request_id for r in self.waiting])
            self.seen_thresholds.append(self.scheduler_config.long_prefill_token_threshold)
            if self.fail_next_schedule:
                raise RuntimeError("model runner fell over")
            while self.waiting:
                self.running.append(self.waiting.popleft())
            output = StepOutput()
            for request in self.running:
                request.num_computed_tokens += request.tokens_per_step
                output.num_scheduled_tokens[request.request_id] = request.tokens_per_step
                output.total_num_scheduled_tokens += request.tokens_per_step
            return output

    return StubScheduler


@pytest.fixture
def scheduler() -> Any:
    return paired(make_scheduler_class())()


@pytest.fixture(autouse=True)
def restore_suffix_registry():
    saved = set(pair_ids._UNCOND_REQUEST_ID_SUFFIXES)
    yield
    pair_ids._UNCOND_REQUEST_ID_SUFFIXES.clear()
    pair_ids._UNCOND_REQUEST_ID_SUFFIXES.update(saved)


def cond(request_id: str = "req-1", **extra: Any) -> StubRequest:
    return StubRequest(request_id, {"cfg_role": "cond", **extra})


def uncond(request_id: str = "req-1__cfg_uncond", **extra: Any) -> StubRequest:
    return StubRequest(request_id, {"cfg_role": "uncond", **extra})


def ids(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


# ---------------------------------------------------------------- pair ids


def test_pair_id_is_the_cond_id_and_the_uncond_id_without_its_suffix(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(uncond())

    assert scheduler._cfg_pairs == {"req-1": {"cond": "req-1", "uncond": "req-1__cfg_uncond"}}
    assert scheduler._cfg_req_to_pair == {"req-1": "req-1", "req-1__cfg_uncond": "req-1"}


def test_a_registered_suffix_is_listed_and_stripped(scheduler: Any) -> None:
    register_cfg_uncond_suffix("::negative")
    assert "::negative" in cfg_uncond_suffixes()

    scheduler.add_request(cond("music-7"))
    scheduler.add_request(uncond("music-7::negative"))

    assert scheduler._cfg_pairs == {"music-7": {"cond": "music-7", "uncond": "music-7::negative"}}


def test_the_longest_matching_suffix_wins() -> None:
    register_cfg_uncond_suffix("_uncond")
    assert pair_ids.strip_uncond_suffix("req-1__cfg_uncond") == "req-1"
    assert pair_ids.strip_uncond_suffix("req-1_uncond") == "req-1"
    assert pair_ids.strip_uncond_suffix("req-cfg_uncond") == "req-cfg"  # "_uncond" matches, "__cfg_uncond" does not


@pytest.mark.parametrize("bad", ["", None, 3])
def test_registering_an_empty_or_non_string_suffix_is_refused(bad: Any) -> None:
    before = cfg_uncond_suffixes()
    with pytest.raises(ValueError, match="non-empty string"):
        register_cfg_uncond_suffix(bad)
    assert cfg_uncond_suffixes() == before


def test_default_suffix_is_registered() -> None:
    assert pair_ids.DEFAULT_UNCOND_SUFFIX == "__cfg_uncond"
    assert "__cfg_uncond" in cfg_uncond_suffixes()


def test_uncond_without_a_known_suffix_is_an_incomplete_pair_of_its_own(scheduler: Any) -> None:
    scheduler.add_request(StubRequest("solo-uncond", {"cfg_role": "uncond"}))

    assert scheduler._cfg_pairs == {"solo-uncond": {"uncond": "solo-uncond"}}


def test_explicit_pair_id_beats_derivation(scheduler: Any) -> None:
    scheduler.add_request(cond(cfg_pair_id="pair-A"))
    scheduler.add_request(uncond(cfg_pair_id="pair-A"))

    assert scheduler._cfg_pairs == {"pair-A": {"cond": "req-1", "uncond": "req-1__cfg_uncond"}}
    assert "req-1" not in scheduler._cfg_pairs
    assert scheduler._cfg_req_to_pair["req-1__cfg_uncond"] == "pair-A"


def test_the_user_facing_id_is_used_when_the_engine_renamed_the_request(scheduler: Any) -> None:
    renamed = uncond("req-1__cfg_uncond-7f3a9c21")
    renamed.external_req_id = "req-1__cfg_uncond"
    scheduler.add_request(renamed)

    assert scheduler._cfg_req_to_pair == {"req-1__cfg_uncond-7f3a9c21": "req-1"}


def test_both_members_skip_prefix_cache_reads(scheduler: Any) -> None:
    member_a, member_b, plain = cond(), uncond(), StubRequest("plain", {"seed": 1})
    for request in (member_a, member_b, plain):
        scheduler.add_request(request)

    assert member_a.skip_reading_prefix_cache is True
    assert member_b.skip_reading_prefix_cache is True
    assert plain.skip_reading_prefix_cache is False


def test_an_unknown_role_runs_as_plain_traffic(scheduler: Any) -> None:
    scheduler.add_request(StubRequest("typo", {"cfg_role": "conditional"}))

    assert scheduler._cfg_pairs == {}


def test_a_second_member_of_the_same_role_is_not_paired(scheduler: Any) -> None:
    scheduler.add_request(cond("a", cfg_pair_id="p"))
    scheduler.add_request(cond("b", cfg_pair_id="p"))

    assert scheduler._cfg_pairs == {"p": {"cond": "a"}}
    assert "b" not in scheduler._cfg_req_to_pair


# ---------------------------------------------------------------- admission holding


def test_a_lone_member_is_hidden_from_the_base_scheduler_and_put_back(scheduler: Any) -> None:
    scheduler.add_request(cond())

    scheduler.schedule()

    assert scheduler.seen_waiting == [[]]
    assert ids(scheduler.waiting) == ["req-1"]
    assert scheduler.running == []
    assert scheduler._cfg_hold_counts == {"req-1": 1}


def test_a_completed_pair_is_admitted_in_one_step(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.schedule()
    scheduler.add_request(uncond())

    scheduler.schedule()

    assert scheduler.seen_waiting[-1] == ["req-1", "req-1__cfg_uncond"]
    assert ids(scheduler.running) == ["req-1", "req-1__cfg_uncond"]
    assert list(scheduler.waiting) == []
    assert scheduler._cfg_hold_counts == {}


def test_the_hold_budget_releases_a_lone_member_unguided(scheduler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(scheduler), "max_pair_hold_steps", 2)
    scheduler.add_request(cond())

    scheduler.schedule()
    scheduler.schedule()
    assert scheduler.running == []
    assert scheduler._cfg_pairs

    scheduler.schedule()

    assert scheduler._cfg_pairs == {}
    assert scheduler._cfg_req_to_pair == {}
    assert scheduler._cfg_hold_counts == {}
    assert ids(scheduler.running) == ["req-1"]


def test_a_partner_arriving_after_release_runs_as_plain_traffic(
    scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(type(scheduler), "max_pair_hold_steps", 1)
    scheduler.add_request(cond())
    scheduler.schedule()
    scheduler.schedule()  # released
    late = uncond()

    scheduler.add_request(late)
    scheduler.schedule()

    assert scheduler._cfg_pairs == {}
    assert late.skip_reading_prefix_cache is False
    assert ids(scheduler.running) == ["req-1", "req-1__cfg_uncond"]


def test_held_requests_go_back_even_if_the_base_schedule_raises(scheduler: Any) -> None:
    scheduler.add_request(StubRequest("plain"))
    scheduler.add_request(cond())
    scheduler.fail_next_schedule = True

    with pytest.raises(RuntimeError, match="fell over"):
        scheduler.schedule()

    assert ids(scheduler.waiting) == ["req-1", "plain"]
    assert scheduler.scheduler_config.long_prefill_token_threshold == 4096


def test_a_member_whose_partner_is_parked_in_another_queue_is_held() -> None:
    scheduler = paired(make_scheduler_class(with_skipped_queue=True))()
    member, partner = cond(), uncond()
    scheduler.add_request(member)
    scheduler.add_request(partner)
    scheduler.waiting.remove_requests([partner])
    scheduler.skipped_waiting.append(partner)

    scheduler.schedule()

    assert scheduler.seen_waiting == [[]]
    assert ids(scheduler.waiting) == ["req-1"]
    assert ids(scheduler.skipped_waiting) == ["req-1__cfg_uncond"]
    assert scheduler._cfg_hold_counts == {"req-1": 1, "req-1__cfg_uncond": 1}


# ---------------------------------------------------------------- reorder and chunking


def test_partners_are_moved_next_to_each_other(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(StubRequest("other"))
    scheduler.add_request(uncond())

    scheduler.schedule()

    assert scheduler.seen_waiting[-1] == ["req-1", "req-1__cfg_uncond", "other"]


def test_reorder_keeps_the_relative_order_of_everything_else(scheduler: Any) -> None:
    for request in (
        StubRequest("p1"),
        uncond("b__cfg_uncond"),
        cond("a"),
        StubRequest("p2"),
        cond("b"),
        uncond("a__cfg_uncond"),
    ):
        scheduler.add_request(request)

    scheduler.schedule()

    assert scheduler.seen_waiting[-1] == ["p1", "b__cfg_uncond", "b", "a", "a__cfg_uncond", "p2"]


def test_the_long_prefill_chunk_is_capped_at_half_the_budget_for_one_call(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(uncond())

    scheduler.schedule()

    assert scheduler.seen_thresholds == [256]
    assert scheduler.scheduler_config.long_prefill_token_threshold == 4096


# ---------------------------------------------------------------- equalization


def equalize_case(cc: int, uc: int, cs: int, us: int) -> tuple[Any, StepOutput, StubRequest, StubRequest]:
    member_a, member_b = cond(), uncond()
    member_a.num_computed_tokens, member_b.num_computed_tokens = cc, uc
    holder = SimpleNamespace(
        _cfg_pairs={"req-1": {"cond": "req-1", "uncond": "req-1__cfg_uncond"}},
        requests={"req-1": member_a, "req-1__cfg_uncond": member_b},
    )
    output = StepOutput({"req-1": cs, "req-1__cfg_uncond": us}, cs + us)
    return holder, output, member_a, member_b


def test_equalize_takes_the_lead_back_from_the_member_ahead() -> None:
    holder, output, member_a, member_b = equalize_case(10, 6, 5, 4)

    equalize_cfg_pair_progress(holder, output)

    assert (member_a.num_computed_tokens, member_b.num_computed_tokens) == (6, 6)
    assert output.num_scheduled_tokens == {"req-1": 1, "req-1__cfg_uncond": 4}
    assert output.total_num_scheduled_tokens == 5


def test_equalize_leaves_an_aligned_pair_alone() -> None:
    holder, output, member_a, member_b = equalize_case(8, 8, 4, 4)

    equalize_cfg_pair_progress(holder, output)

    assert (member_a.num_computed_tokens, member_b.num_computed_tokens) == (8, 8)
    assert output.num_scheduled_tokens == {"req-1": 4, "req-1__cfg_uncond": 4}
    assert output.total_num_scheduled_tokens == 8


def test_equalize_skips_a_rollback_that_would_leave_a_member_without_tokens() -> None:
    holder, output, member_a, _ = equalize_case(10, 6, 4, 4)

    equalize_cfg_pair_progress(holder, output)

    assert member_a.num_computed_tokens == 10
    assert output.total_num_scheduled_tokens == 8


def test_equalize_skips_a_pair_with_an_unscheduled_member() -> None:
    holder, output, member_a, _ = equalize_case(10, 6, 5, 0)

    equalize_cfg_pair_progress(holder, output)

    assert member_a.num_computed_tokens == 10
    assert output.total_num_scheduled_tokens == 5


def test_the_patched_schedule_equalizes_members_with_different_step_sizes(scheduler: Any) -> None:
    scheduler.add_request(StubRequest("req-1", {"cfg_role": "cond"}, tokens_per_step=4))
    scheduler.add_request(StubRequest("req-1__cfg_uncond", {"cfg_role": "uncond"}, tokens_per_step=3))

    output = scheduler.schedule()

    assert output.num_scheduled_tokens == {"req-1": 3, "req-1__cfg_uncond": 3}
    assert output.total_num_scheduled_tokens == 6
    assert [r.num_computed_tokens for r in scheduler.running] == [3, 3]


# ---------------------------------------------------------------- split pairs


def test_a_member_running_alone_past_its_prompt_releases_the_pair(scheduler: Any) -> None:
    member_a, member_b = cond(), uncond()
    member_a.num_prompt_tokens = member_b.num_prompt_tokens = 1
    scheduler.add_request(member_a)
    scheduler.add_request(member_b)
    scheduler.schedule()
    scheduler.running.remove(member_b)  # e.g. preempted: out of the running set, still a live request

    scheduler.schedule()

    assert scheduler._cfg_pairs == {}
    assert scheduler._cfg_req_to_pair == {}
    assert "req-1" in scheduler._cfg_released_pairs


def test_a_member_running_alone_inside_its_prompt_keeps_the_pair(scheduler: Any) -> None:
    member_a, member_b = cond(), uncond()
    member_a.num_prompt_tokens = member_b.num_prompt_tokens = 100
    scheduler.add_request(member_a)
    scheduler.add_request(member_b)
    scheduler.schedule()
    scheduler.running.remove(member_b)

    scheduler.schedule()

    assert scheduler._cfg_pairs == {"req-1": {"cond": "req-1", "uncond": "req-1__cfg_uncond"}}


# ---------------------------------------------------------------- finish


def test_finishing_one_member_finishes_both_in_one_call(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(uncond())
    scheduler.schedule()

    scheduler.finish_requests("req-1", "FINISHED_STOPPED")

    assert scheduler.finish_calls == [({"req-1", "req-1__cfg_uncond"}, "FINISHED_STOPPED")]
    assert scheduler._cfg_pairs == {}
    assert scheduler._cfg_req_to_pair == {}
    assert scheduler.running == []


def test_finishing_everything_clears_the_registries(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(uncond())
    scheduler.schedule()

    scheduler.finish_requests(None, "FINISHED_ABORTED")

    assert scheduler._cfg_pairs == {}
    assert scheduler._cfg_req_to_pair == {}
    assert scheduler.requests == {}


def test_pairs_whose_members_are_all_gone_are_forgotten(scheduler: Any) -> None:
    scheduler.add_request(cond())
    scheduler.add_request(uncond())
    scheduler.add_request(StubRequest("plain"))
    scheduler.schedule()
    # Both stopped on their own, outside finish_requests.
    for request_id in ("req-1", "req-1__cfg_uncond"):
        scheduler.running.remove(scheduler.requests.pop(request_id))

    scheduler.schedule()

    assert scheduler._cfg_pairs == {}
    assert scheduler._cfg_req_to_pair == {}


# ---------------------------------------------------------------- plain traffic and patching


def test_plain_requests_take_the_original_path(scheduler: Any) -> None:
    scheduler.add_request(StubRequest("plain-1", None))
    scheduler.add_request(StubRequest("plain-2", {"seed": 3}))

    output = scheduler.schedule()
    scheduler.finish_requests("plain-1", "FINISHED_STOPPED")

    assert scheduler._cfg_pairs == {}
    assert scheduler.seen_waiting == [["plain-1", "plain-2"]]
    assert scheduler.seen_thresholds == [4096]
    assert output.num_scheduled_tokens == {"plain-1": 1, "plain-2": 1}
    assert output.total_num_scheduled_tokens == 2
    assert scheduler.finish_calls == [({"plain-1"}, "FINISHED_STOPPED")]
    assert scheduler._cfg_hold_counts == {}


def test_plain_stand_in_without_the_mixin_never_pairs() -> None:
    scheduler = make_scheduler_class()()
    scheduler.add_request(cond())

    scheduler.schedule()

    assert ids(scheduler.running) == ["req-1"]  # a lone cond member runs at once: nobody holds it
    assert not hasattr(scheduler, "_cfg_pairs")


def test_an_unhashable_pair_id_runs_as_plain_traffic(scheduler: Any) -> None:
    scheduler.add_request(cond(cfg_pair_id=["not", "hashable"]))

    assert scheduler._cfg_pairs == {}
    assert ids(scheduler.waiting) == ["req-1"]


def test_instances_never_share_registries() -> None:
    cls = paired(make_scheduler_class())
    first, second = cls(), cls()
    first.add_request(cond())
    first.add_request(uncond())

    assert first._cfg_pairs == {"req-1": {"cond": "req-1", "uncond": "req-1__cfg_uncond"}}
    assert second._cfg_pairs == {}
    first.schedule()
    assert ids(first.running) == ["req-1", "req-1__cfg_uncond"]
