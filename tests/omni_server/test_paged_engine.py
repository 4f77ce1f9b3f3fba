"""The engine core with the paged strategy in-process, on the real pipeline and the real diffusion_kv scheduler (CPU).

Properties the HTTP tests cannot see directly: rows of requests at different step
indices share one forward; every request gets exactly one ``RequestFinished``
whatever the interleaving of adds and aborts; the pool returns to its idle count.
"""

from __future__ import annotations

import os
import random

import pytest

from omni_models import GenerationRequest, resolve_request
from omni_server.config import build_config
from omni_server.engine import build_engine
from omni_server.protocol import RequestFinished

MODEL = os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny")


@pytest.fixture(scope="module")
def engine():
    engine = build_engine(
        build_config(None, model=MODEL, device="cpu", max_num_seqs=3, kv_cache_memory_bytes="24M", warmup=False)
    )
    yield engine
    engine.close()


def _run_until_idle(engine, limit: int = 500) -> list[RequestFinished]:
    finished = []
    for _ in range(limit):
        if not engine.has_work():
            return finished
        finished += [output for output in engine.step() if isinstance(output, RequestFinished)]
    raise AssertionError(f"engine still busy after {limit} iterations")


def _params(
    steps: int, n: int = 1, guidance: float = 1.0, prompt: str = "a red circle", seed: int = 1
) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, n=n, num_inference_steps=steps, guidance_scale=guidance, seed=seed)


def _add(engine, request_id: str, request: GenerationRequest) -> None:
    engine.add(request_id, resolve_request(engine.info, request))


def _blocks_in_use(engine) -> int:
    stats = engine.stats()
    return stats.kv_blocks_used


def test_requests_at_different_steps_share_one_forward(engine, monkeypatch) -> None:
    batches: list[list[tuple[str, int]]] = []
    real_step = engine.pipeline.step

    def recording_step(jobs):
        batches.append([(job.request_id, job.step_index) for job in jobs])
        real_step(jobs)

    monkeypatch.setattr(engine.pipeline, "step", recording_step)
    _add(engine, "first", _params(steps=3))
    engine.step()
    _add(engine, "second", _params(steps=2, n=2, guidance=4.0))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert batches[0] == [("first", 0)]
    # One forward: "first" at step 1 together with both images of "second" at step 0.
    assert sorted(batches[1]) == [("first", 1), ("second", 0), ("second", 0)]
    assert sorted(batches[2]) == [("first", 2), ("second", 1), ("second", 1)]
    assert len(batches) == 3
    assert len(finished["first"].outputs) == 1 and len(finished["second"].outputs) == 2
    assert _blocks_in_use(engine) == 0


def test_a_bad_request_fails_alone_before_it_owns_anything(engine) -> None:
    _add(engine, "bad", _params(steps=1, prompt="a zebra"))
    _add(engine, "good", _params(steps=1))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert finished["bad"].error is not None and finished["bad"].error.param == "prompt"
    assert finished["good"].error is None and len(finished["good"].outputs) == 1
    assert _blocks_in_use(engine) == 0


def test_random_adds_and_aborts_finish_every_request_once_and_free_every_block(engine) -> None:
    rng = random.Random(0)
    added: list[str] = []
    finished: list[RequestFinished] = []
    for i in range(16):
        request_id = f"r{i}"
        _add(engine, request_id, _params(steps=rng.randint(1, 2), n=rng.randint(1, 2), guidance=rng.choice([1.0, 4.0])))
        added.append(request_id)
        if rng.random() < 0.4:
            engine.abort(rng.choice(added))
        for _ in range(rng.randint(0, 2)):
            finished += [o for o in engine.step() if isinstance(o, RequestFinished)]
            assert _blocks_in_use(engine) <= engine.stats().kv_blocks_total
    finished += _run_until_idle(engine)
    ids = [output.request_id for output in finished]
    assert sorted(ids) == sorted(added)  # exactly one answer per request
    for output in finished:
        aborted = output.error is not None and output.error.kind == "aborted"
        assert aborted or output.error is None, output
        assert aborted or len(output.outputs) >= 1
    kinds = [output.error.kind if output.error else None for output in finished]
    assert "aborted" in kinds and None in kinds
    assert _blocks_in_use(engine) == 0
    assert not engine.has_work() and engine.stats().running == engine.stats().waiting == 0


def test_a_request_that_breaks_a_shared_forward_fails_alone(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_SERVER_FAULT_PROMPT", "a black triangle")  # read when the engine is built
    engine = build_engine(
        build_config(None, model=MODEL, device="cpu", max_num_seqs=3, kv_cache_memory_bytes="24M", warmup=False)
    )
    try:
        steps: list[list[str]] = []
        real_step = engine.pipeline.step

        def recording_step(jobs):
            steps.append(sorted(job.request_id for job in jobs))
            real_step(jobs)

        monkeypatch.setattr(engine.pipeline, "step", recording_step)
        _add(engine, "good", _params(steps=2, guidance=4.0))
        _add(engine, "bad", _params(steps=2, prompt="a black triangle"))
        finished = {output.request_id: output for output in _run_until_idle(engine)}
        assert finished["bad"].error is not None and finished["bad"].error.kind == "engine"
        assert "injected engine fault" in finished["bad"].error.message
        assert finished["good"].error is None and len(finished["good"].outputs) == 1
        # "good" took exactly its two steps, each once: the failed batch never advanced it twice.
        assert steps == [["good"], ["good"]]

        _add(engine, "alone", _params(steps=2, guidance=4.0))
        alone = {output.request_id: output for output in _run_until_idle(engine)}["alone"]
        assert alone.outputs == finished["good"].outputs  # same request, same seed: same PNG bytes
        assert _blocks_in_use(engine) == 0
    finally:
        engine.close()


def test_a_batch_that_fails_after_stepping_still_fails_only_its_culprit(engine, monkeypatch) -> None:
    """The forward raises after the jobs advanced: the retry fails the culprit, the other job's image is right."""
    real_step = engine.pipeline.step
    advances: dict[str, int] = {}

    def step_then_fail_with_bad(jobs):
        real_step(jobs)
        for job in jobs:
            advances[job.request_id] = advances.get(job.request_id, 0) + 1
        if any(job.request_id == "bad" for job in jobs):
            raise RuntimeError("forward failed after stepping")

    monkeypatch.setattr(engine.pipeline, "step", step_then_fail_with_bad)
    _add(engine, "good", _params(steps=3, guidance=4.0))
    _add(engine, "bad", _params(steps=3, prompt="a blue square"))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert finished["bad"].error is not None and "after stepping" in finished["bad"].error.message
    assert finished["good"].error is None and advances["good"] == 3

    monkeypatch.setattr(engine.pipeline, "step", real_step)
    _add(engine, "alone", _params(steps=3, guidance=4.0))
    alone = {output.request_id: output for output in _run_until_idle(engine)}["alone"]
    assert alone.outputs == finished["good"].outputs
    assert _blocks_in_use(engine) == 0


def test_a_small_request_overtakes_a_big_one_that_must_wait(engine) -> None:
    """The scheduler's fair policy: behind a big request that cannot fit yet, a small one that fits runs at once."""
    big = _params(steps=3, n=6, guidance=4.0)  # 12 rows: more than half of this pool
    _add(engine, "big-1", big)
    engine.step()
    _add(engine, "big-2", big)
    _add(engine, "small", _params(steps=2))
    engine.step()
    running = {item.request_id for item in engine.stats().progress}
    assert "small" in running and "big-2" not in running  # FIFO alone would keep "small" behind "big-2"
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert set(finished) == {"big-1", "big-2", "small"}
    assert all(output.error is None for output in finished.values())
    assert _blocks_in_use(engine) == 0


def test_a_waiting_request_is_admitted_once_slow_encodes_free_the_pool_without_spinning(engine, monkeypatch) -> None:
    """While a finished request's files encode (on the engine's threads) and another waits for its blocks, each
    engine iteration waits for the next file. With a half-encoded request it waited on files already done, so the
    loop spun: the 500 iterations below ran out before the encodes did (seen once in CI, under load)."""
    import time

    from omni_server import engine as engine_module

    encode = engine_module.encode_output

    def slow_encode(*args, **kwargs):
        time.sleep(0.15)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine_module, "encode_output", slow_encode)
    big = _params(steps=1, n=6, guidance=4.0)  # 12 rows: the second must wait for the first's blocks
    _add(engine, "first", big)
    _add(engine, "second", big)
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert set(finished) == {"first", "second"} and all(output.error is None for output in finished.values())
    assert _blocks_in_use(engine) == 0


def test_a_short_request_advances_in_every_forward_beside_a_long_one() -> None:
    """Row budget 4: a 2-step image finishes in 2 forwards while a 12-row request takes turns, none starving."""
    engine = build_engine(
        build_config(
            None,
            model=MODEL,
            device="cpu",
            max_num_seqs=3,
            max_rows_per_step=4,
            kv_cache_memory_bytes="24M",
            warmup=False,
        )
    )
    try:
        _add(engine, "long", _params(steps=6, n=6, guidance=4.0))
        engine.step()
        _add(engine, "short", _params(steps=2, guidance=4.0))
        iterations = 0
        finished: dict[str, RequestFinished] = {}
        while "short" not in finished:
            finished.update({o.request_id: o for o in engine.step() if isinstance(o, RequestFinished)})
            iterations += 1
            assert iterations <= 3, "the short request waited behind the long one"
        long_jobs = next(r.jobs for r in engine._running if r.request_id == "long")
        assert sum(job.step_index for job in long_jobs) >= 2  # it kept advancing too
        finished.update({o.request_id: o for o in _run_until_idle(engine)})
        assert finished["long"].error is None and len(finished["long"].outputs) == 6
        assert _blocks_in_use(engine) == 0
    finally:
        engine.close()


def test_step_selection_prefers_the_fewest_steps_left_and_never_starves() -> None:
    from types import SimpleNamespace

    from omni_server.scheduling_policy import StepSelection

    def job(name: str, rows: int, left: int):
        return SimpleNamespace(name=name, num_rows=rows, num_steps=100, step_index=100 - left)

    long_jobs = [job(f"long{i}", 2, 90) for i in range(4)]
    short = job("short", 2, 2)
    selection = StepSelection(max_rows=4, max_skipped_rounds=1)
    picked = [s.name for s in selection.select([*long_jobs, short])]
    assert "short" in picked and len(picked) == 2
    seen: dict[str, int] = {}
    for _ in range(6):  # a stream of short jobs never keeps a long one out for more than one round (3 forwards)
        for s in selection.select([*long_jobs, job("short", 2, 1)]):
            seen[s.name] = seen.get(s.name, 0) + 1
    assert set(seen) >= {s.name for s in long_jobs}
    assert StepSelection(max_rows=0).select(long_jobs) == long_jobs


def _images_of(engine, params_by_id: dict[str, GenerationRequest]) -> dict[str, list[bytes]]:
    for request_id, params in params_by_id.items():
        _add(engine, request_id, params)
    finished = {o.request_id: o for o in _run_until_idle(engine)}
    assert all(o.error is None for o in finished.values())
    return {request_id: finished[request_id].outputs for request_id in params_by_id}


def test_batch_invariant_mode_gives_single_request_bits() -> None:
    engine = build_engine(
        build_config(
            None,
            model=MODEL,
            device="cpu",
            max_num_seqs=3,
            batch_invariant=True,
            kv_cache_memory_bytes="48M",
            warmup=False,
        )
    )
    try:
        # Without the mode, 3 of these 10 images differ from their single-request twins by one level somewhere.
        params = GenerationRequest(
            prompt="a red circle at the top", n=10, num_inference_steps=3, guidance_scale=4.0, seed=11
        )
        batched = _images_of(engine, {"batched": params, "other": _params(steps=5, n=2, guidance=4.0)})["batched"]
        singles = [
            _images_of(
                engine,
                {
                    f"single-{i}": GenerationRequest(
                        prompt=params.prompt, n=1, num_inference_steps=3, guidance_scale=4.0, seed=11 + i
                    )
                },
            )[f"single-{i}"][0]
            for i in range(10)
        ]
        assert batched == singles
    finally:
        engine.close()
