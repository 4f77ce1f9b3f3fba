"""Step caching in the engine core (issue 26): four concurrent requests with off, safe, fast and a custom cache in
the same batched steps each give the image they give alone (bitwise under ``--batch-invariant``, >= 40 dB
otherwise), their stats come back with the answer, and the step-cache memory bound holds requests back, refuses
one that can never fit, and is given back when requests end."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni_models import GenerationRequest, resolve_request
from omni_server.config import build_config
from omni_server.protocol import RequestFinished

CACHES = ("off", "safe", "fast", {"threshold": 1.5, "warmup_steps": 1, "max_consecutive_cached": 2, "taylor_order": 2})


def _engine(pipeline, **config):
    from omni_server.engine import EngineCore

    return EngineCore(pipeline, build_config(None, model="unused", device="cpu", warmup=False, **config))


def _run(engine, requests: dict[str, GenerationRequest], limit: int = 60) -> dict[str, RequestFinished]:
    for request_id, request in requests.items():
        engine.add(request_id, resolve_request(engine.info, request))
    done: dict[str, RequestFinished] = {}
    for _ in range(limit):
        if not engine.has_work():
            break
        done.update({o.request_id: o for o in engine.step() if isinstance(o, RequestFinished)})
    return done


def _requests(**fields) -> dict[str, GenerationRequest]:
    return {
        f"r{i}": GenerationRequest(prompt="a red circle" if i % 2 else "a blue square", seed=i, cache=cache, **fields)
        for i, cache in enumerate(CACHES)
    }


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


@pytest.fixture(scope="module")
def flux(family_dirs):
    import omni_models

    return omni_models.load(str(family_dirs["flux"]))


@pytest.fixture(scope="module")
def shipped():
    import omni_models

    return omni_models.load("omni-shapes-tiny", device="cpu")


def test_batch_invariant_cached_requests_are_bitwise_their_alone_images(flux) -> None:
    requests = _requests(height=32, width=32, num_inference_steps=5)
    together = _run(_engine(flux, batch_invariant=True), requests)
    for request_id, request in requests.items():
        alone = _run(_engine(flux, batch_invariant=True), {request_id: request})[request_id]
        assert together[request_id].outputs == alone.outputs, request_id
        assert together[request_id].step_cache == alone.step_cache
    assert together["r0"].step_cache == [] and together["r3"].step_cache[0].computed_steps < 5


def test_cached_requests_in_shared_paged_forwards_match_their_alone_images(shipped, tools) -> None:
    requests = _requests(num_inference_steps=4)
    engine = _engine(shipped, max_rows_per_step=0)
    together = _run(engine, requests)
    for request_id, request in requests.items():
        alone = _run(_engine(shipped), {request_id: request})[request_id]
        assert tools.psnr(_pixels(together[request_id].outputs[0]), _pixels(alone.outputs[0])) >= 40.0, request_id
        assert [s.decisions for s in together[request_id].step_cache] == [s.decisions for s in alone.step_cache]
    assert engine._strategy.step_cache.used == 0  # every request's bound given back


def test_the_step_cache_memory_bound_holds_requests_back_and_refuses_what_never_fits(shipped) -> None:
    resolved = resolve_request(shipped.info, GenerationRequest(prompt="red circle", cache="fast"))
    one = sum(shipped.step_cache_bytes(job) for job in shipped.prepare(resolved))
    assert one > 0
    engine = _engine(shipped, step_cache_memory_bytes=one)
    fields = dict(num_inference_steps=2, cache="fast")
    engine.add("a", resolve_request(engine.info, GenerationRequest(prompt="red circle", seed=1, **fields)))
    engine.add("b", resolve_request(engine.info, GenerationRequest(prompt="red circle", seed=2, **fields)))
    engine.add("big", resolve_request(engine.info, GenerationRequest(prompt="red circle", n=2, **fields)))
    first = engine.step()
    refused = [o for o in first if isinstance(o, RequestFinished) and o.request_id == "big"]
    assert refused and refused[0].error.kind == "capacity" and refused[0].error.param == "cache"
    assert first[-1].running == 1 and first[-1].waiting == 1  # b waits for a's cache memory
    done = {}
    while engine.has_work():
        done.update({o.request_id: o for o in engine.step() if isinstance(o, RequestFinished)})
    assert all(done[r].error is None for r in ("a", "b")) and engine._strategy.step_cache.used == 0
