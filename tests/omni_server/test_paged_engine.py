"""The paged engine in-process, on the real pipeline and the real diffusion_kv scheduler (CPU).

Properties the HTTP tests cannot see directly: rows of requests at different step
indices share one forward; every request gets exactly one ``RequestFinished``
whatever the interleaving of adds and aborts; the pool returns to its idle count.
"""

from __future__ import annotations

import os
import random

import pytest

from omni_server.config import build_config
from omni_server.engine import build_engine
from omni_server.protocol import GenerationParams, RequestFinished

MODEL = os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny")


@pytest.fixture(scope="module")
def engine():
    engine = build_engine(build_config(None, model=MODEL, device="cpu", max_num_seqs=3,
                                       kv_cache_memory_bytes="24M", warmup=False))
    yield engine
    engine.close()


def _run_until_idle(engine, limit: int = 500) -> list[RequestFinished]:
    finished = []
    for _ in range(limit):
        if not engine.has_work():
            return finished
        finished += [output for output in engine.step() if isinstance(output, RequestFinished)]
    raise AssertionError(f"engine still busy after {limit} iterations")


def _params(steps: int, n: int = 1, guidance: float = 1.0, prompt: str = "a red circle") -> GenerationParams:
    return GenerationParams(prompt=prompt, n=n, num_inference_steps=steps, guidance_scale=guidance, seed=1)


def _blocks_in_use(engine) -> int:
    stats = engine.stats()
    return stats.kv_blocks_used


def test_requests_at_different_steps_share_one_forward(engine, monkeypatch) -> None:
    batches: list[list[tuple[str, int]]] = []
    real_step = engine._pipeline.run_denoise_step

    def recording_step(batch):
        batches.append([(scheduled.job.request_id, scheduled.job.step_index) for scheduled in batch])
        real_step(batch)

    monkeypatch.setattr(engine._pipeline, "run_denoise_step", recording_step)
    engine.add("first", _params(steps=3))
    engine.step()
    engine.add("second", _params(steps=2, n=2, guidance=4.0))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert batches[0] == [("first", 0)]
    # One forward: "first" at step 1 together with both images of "second" at step 0.
    assert sorted(batches[1]) == [("first", 1), ("second", 0), ("second", 0)]
    assert sorted(batches[2]) == [("first", 2), ("second", 1), ("second", 1)]
    assert len(batches) == 3
    assert len(finished["first"].images) == 1 and len(finished["second"].images) == 2
    assert _blocks_in_use(engine) == 0


def test_a_bad_request_fails_alone_before_it_owns_anything(engine) -> None:
    engine.add("bad", _params(steps=1, prompt="a zebra"))
    engine.add("good", _params(steps=1))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert finished["bad"].error is not None and finished["bad"].error.param == "prompt"
    assert finished["good"].error is None and len(finished["good"].images) == 1
    assert _blocks_in_use(engine) == 0


def test_random_adds_and_aborts_finish_every_request_once_and_free_every_block(engine) -> None:
    rng = random.Random(0)
    added: list[str] = []
    finished: list[RequestFinished] = []
    for i in range(16):
        request_id = f"r{i}"
        engine.add(request_id, _params(steps=rng.randint(1, 2), n=rng.randint(1, 2), guidance=rng.choice([1.0, 4.0])))
        added.append(request_id)
        if rng.random() < 0.4:
            engine.abort(rng.choice(added))
        for _ in range(rng.randint(0, 2)):
            finished += [o for o in engine.step() if isinstance(o, RequestFinished)]
            assert _blocks_in_use(engine) <= engine._manager.empty_pool_num_free_blocks
    finished += _run_until_idle(engine)
    ids = [output.request_id for output in finished]
    assert sorted(ids) == sorted(added)  # exactly one answer per request
    for output in finished:
        assert output.aborted or output.error is None, output
        assert output.aborted or len(output.images) >= 1
    assert any(output.aborted for output in finished) and any(not output.aborted for output in finished)
    assert _blocks_in_use(engine) == 0
    assert not engine._scheduler.has_requests()


def test_a_request_that_breaks_a_shared_forward_fails_alone(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_SERVER_FAULT_PROMPT", "a black triangle")  # read when the engine is built
    engine = build_engine(build_config(None, model=MODEL, device="cpu", max_num_seqs=3,
                                       kv_cache_memory_bytes="24M", warmup=False))
    try:
        steps: list[list[str]] = []
        real_step = engine._pipeline.run_denoise_step

        def recording_step(batch):
            steps.append(sorted(scheduled.job.request_id for scheduled in batch))
            real_step(batch)

        monkeypatch.setattr(engine._pipeline, "run_denoise_step", recording_step)
        engine.add("good", _params(steps=2, guidance=4.0))
        engine.add("bad", _params(steps=2, prompt="a black triangle"))
        finished = {output.request_id: output for output in _run_until_idle(engine)}
        assert finished["bad"].error is not None and finished["bad"].error.kind == "engine"
        assert "injected engine fault" in finished["bad"].error.message
        assert finished["good"].error is None and len(finished["good"].images) == 1
        # "good" took exactly its two steps, each once: the failed batch never advanced it twice.
        assert steps == [["good"], ["good"]]

        engine.add("alone", _params(steps=2, guidance=4.0))
        alone = {output.request_id: output for output in _run_until_idle(engine)}["alone"]
        assert alone.images == finished["good"].images  # same request, same seed: same PNG bytes
        assert _blocks_in_use(engine) == 0
    finally:
        engine.close()


def test_a_batch_that_fails_after_stepping_still_fails_only_its_culprit(engine, monkeypatch) -> None:
    """The forward raises after the jobs advanced: the retry fails the culprit, the other job's image is right."""
    real_step = engine._pipeline.run_denoise_step
    advances: dict[str, int] = {}

    def step_then_fail_with_bad(batch):
        real_step(batch)
        for scheduled in batch:
            advances[scheduled.job.request_id] = advances.get(scheduled.job.request_id, 0) + 1
        if any(scheduled.job.request_id == "bad" for scheduled in batch):
            raise RuntimeError("forward failed after stepping")

    monkeypatch.setattr(engine._pipeline, "run_denoise_step", step_then_fail_with_bad)
    engine.add("good", _params(steps=3, guidance=4.0))
    engine.add("bad", _params(steps=3, prompt="a blue square"))
    finished = {output.request_id: output for output in _run_until_idle(engine)}
    assert finished["bad"].error is not None and "after stepping" in finished["bad"].error.message
    assert finished["good"].error is None and advances["good"] == 3

    monkeypatch.setattr(engine._pipeline, "run_denoise_step", real_step)
    engine.add("alone", _params(steps=3, guidance=4.0))
    alone = {output.request_id: output for output in _run_until_idle(engine)}["alone"]
    assert alone.images == finished["good"].images
    assert _blocks_in_use(engine) == 0
