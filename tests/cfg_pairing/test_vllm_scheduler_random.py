"""Random workloads on vLLM's real ``Scheduler``: pairs sample in step, finish together, nothing leaks."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the real-scheduler tests need vLLM: pip install 'cfg-pairing[cpu]'")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

request_spec = st.tuples(
    st.integers(min_value=0, max_value=3),  # arrival step
    st.integers(min_value=1, max_value=120),  # prompt length (both members of a pair)
    st.integers(min_value=1, max_value=6),  # max tokens
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    pairs=st.lists(request_spec, min_size=1, max_size=3),
    plain=st.lists(request_spec, max_size=3),
    budget=st.sampled_from([16, 24, 64, 256]),
    max_num_seqs=st.integers(min_value=2, max_value=8),
    num_blocks=st.sampled_from([12, 24, 400]),
    kind=st.sampled_from(["sync", "async"]),
)
def test_random_workloads_keep_pairs_in_step(
    vllm_harness: Any,
    pairs: list[tuple[int, int, int]],
    plain: list[tuple[int, int, int]],
    budget: int,
    max_num_seqs: int,
    num_blocks: int,
    kind: str,
) -> None:
    scheduler = vllm_harness.scheduler(
        kind=kind, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )
    baseline = vllm_harness.free_blocks(scheduler)
    arrivals: dict[int, list[Any]] = {}
    pair_ids = []
    for index, (arrival, prompt_len, max_tokens) in enumerate(pairs):
        cond, uncond = vllm_harness.pair(f"pair-{index}", prompt_len, max_tokens=max_tokens)
        arrivals.setdefault(arrival, []).extend((cond, uncond))
        pair_ids.append((cond.request_id, uncond.request_id))
    for index, (arrival, prompt_len, max_tokens) in enumerate(plain):
        arrivals.setdefault(arrival, []).append(
            vllm_harness.request(f"plain-{index}", [7 + index] * prompt_len, max_tokens=max_tokens)
        )

    token_steps: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    for step in range(600):
        for request in arrivals.pop(step, ()):
            scheduler.add_request(request)
        if not arrivals and not scheduler.has_unfinished_requests():
            break
        record = vllm_harness.step(scheduler)
        for engine_outputs in record.engine_outputs.values():
            for output in engine_outputs.outputs:
                if output.new_token_ids:
                    token_steps.setdefault(output.request_id, []).append(step)
                if output.finish_reason is not None:
                    finished_at[output.request_id] = step
    else:
        raise AssertionError("the workload did not drain in 600 steps")

    released = set(scheduler._cfg_released_pairs)
    for cond_id, uncond_id in pair_ids:
        assert cond_id in finished_at and uncond_id in finished_at
        if cond_id in released:
            continue
        assert token_steps.get(cond_id) == token_steps.get(uncond_id), (cond_id, token_steps)
        assert finished_at[cond_id] == finished_at[uncond_id]
    if num_blocks == 400 and budget >= 64:
        # An ample pool and budget: nothing forces a split, so no pair is given up.
        assert released == set()
    assert vllm_harness.free_blocks(scheduler) == baseline
    assert scheduler.requests == {}
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}
