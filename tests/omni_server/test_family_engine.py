"""The engine core over ``FamilyPipeline`` (the batched strategy) in this process: step-level batching (forwards,
text encoders and VAE decodes counted on the real diffusers-backed pipeline), per-request fields, failures and
aborts."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from omni_models import GenerationRequest, InvalidRequestError, resolve_request
from omni_server.config import build_config
from omni_server.protocol import RequestFinished

pytest.importorskip("diffusers")


class Counter:
    """Wraps one backend method; records the size of each call's first argument."""

    def __init__(self, monkeypatch, backend, name: str) -> None:
        self.calls: list[int] = []
        original = getattr(backend, name)

        def wrapped(items, *args, **kwargs):
            self.calls.append(len(items) if isinstance(items, (list, tuple)) else 1)
            return original(items, *args, **kwargs)

        monkeypatch.setattr(backend, name, wrapped)


@pytest.fixture(scope="module")
def pipelines(family_dirs):
    import omni_models

    return {family: omni_models.load(str(directory)) for family, directory in family_dirs.items()}


def _engine(pipeline, **config):
    from omni_server.engine import EngineCore

    return EngineCore(pipeline, build_config(None, model="unused", device="cpu", warmup=False, **config))


def _add(engine, request_id: str, **fields) -> None:
    engine.add(request_id, resolve_request(engine.info, GenerationRequest(**fields)))


def _finished(outputs) -> dict[str, RequestFinished]:
    return {o.request_id: o for o in outputs if isinstance(o, RequestFinished)}


def _run(engine, limit: int = 50) -> dict[str, RequestFinished]:
    done: dict[str, RequestFinished] = {}
    for _ in range(limit):
        if not engine.has_work():
            break
        done.update(_finished(engine.step()))
    return done


def test_requests_at_different_steps_share_one_forward_and_decode(pipelines, monkeypatch) -> None:
    pipeline = pipelines["flux"]
    engine = _engine(pipeline)
    forwards = Counter(monkeypatch, pipeline.backend, "forward")
    encodes = Counter(monkeypatch, pipeline.backend, "encode")
    decodes = Counter(monkeypatch, pipeline.backend, "decode")
    _add(
        engine, "a", prompt="a red circle", n=2, height=32, width=32, num_inference_steps=3, guidance_scale=2.0, seed=1
    )
    engine.step()
    assert (len(forwards.calls), forwards.calls[0]) == (1, 2)  # a's two images: one forward
    assert len(encodes.calls) == 1  # one prompt, once for both images
    stats = engine.step()[-1]
    assert [(p.request_id, p.step, p.total) for p in stats.progress] == [("a", 2, 3)]
    # b arrives with a at step 2: b's true-CFG rows (cond + uncond) and a's rows share the next forwards.
    _add(
        engine,
        "b",
        prompt="a blue square",
        negative_prompt="blurry",
        height=32,
        width=32,
        num_inference_steps=1,
        guidance_scale=3.5,
        true_cfg_scale=2.0,
        seed=2,
    )
    done = _finished(engine.step())
    assert forwards.calls[2] == 4  # 2 rows of a + cond and uncond of b, in ONE forward
    assert len(encodes.calls) == 3  # b's prompt and its negative prompt, once each
    assert sorted(done) == ["a", "b"] and all(len(o.outputs) == n for o, n in ((done["a"], 2), (done["b"], 1)))
    assert decodes.calls == [3]  # both requests finished together: one VAE decode of 3 latents
    assert engine.stats().running == 0 and not engine.has_work()


def test_different_sizes_run_one_forward_per_size(pipelines, monkeypatch) -> None:
    pipeline = pipelines["qwen-image"]
    engine = _engine(pipeline)
    forwards = Counter(monkeypatch, pipeline.backend, "forward")
    _add(engine, "small", prompt="dog", height=16, width=16, num_inference_steps=2, seed=1)
    _add(engine, "wide", prompt="a cat", height=16, width=32, num_inference_steps=2, seed=1)
    _add(
        engine,
        "small-2",
        prompt="a red circle",
        height=16,
        width=16,
        num_inference_steps=2,
        seed=3,
        negative_prompt="bad quality",
        guidance_scale=1.0,
    )
    done = _run(engine)
    assert sorted(done) == ["small", "small-2", "wide"] and all(o.error is None for o in done.values())
    # Per iteration: 16x16 (small: cond + default " " uncond; small-2: guidance 1 -> no CFG, one row) and 32x16.
    assert sorted(forwards.calls) == [2, 2, 3, 3]


def test_max_num_seqs_admits_fifo_and_the_rest_waits(pipelines) -> None:
    engine = _engine(pipelines["flux"], max_num_seqs=1)
    for name in ("first", "second"):
        _add(engine, name, prompt="a cat", height=16, width=16, num_inference_steps=2, seed=0)
    stats = engine.step()[-1]
    assert (stats.running, stats.waiting) == (1, 1)
    assert sorted(_run(engine)) == ["first", "second"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (dict(height=17, width=16), "size"),
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(guidance_scale=3.0, true_cfg_scale=5.0), "guidance_scale"),  # two CFG scales for Qwen-Image
        (dict(n=11), "n"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field_and_changes_nothing(pipelines, params, param) -> None:
    engine = _engine(pipelines["qwen-image"])
    _add(engine, "good", prompt="dog", height=16, width=16, num_inference_steps=2, seed=0)
    with pytest.raises(InvalidRequestError) as refused:
        _add(engine, "bad", prompt="dog", **{"height": 16, "width": 16, **params})
    assert refused.value.param == param
    done = _run(engine)
    assert sorted(done) == ["good"] and done["good"].error is None and len(done["good"].outputs) == 1


def test_guidance_scale_is_each_familys_own_guidance(pipelines) -> None:
    """Qwen-Image: its true-CFG scale, with the default negative prompt " "; FLUX.1-dev: the embedded guidance."""
    (qwen,) = pipelines["qwen-image"].prepare(
        resolve_request(pipelines["qwen-image"].info, GenerationRequest(prompt="dog", guidance_scale=5.0))
    )
    assert (qwen.guidance, qwen.true_cfg_scale, qwen.conditioning.negative_prompt, qwen.guided) == (
        None,
        5.0,
        " ",
        True,
    )
    (flux,) = pipelines["flux"].prepare(
        resolve_request(pipelines["flux"].info, GenerationRequest(prompt="dog", guidance_scale=5.0))
    )
    assert (flux.guidance, flux.true_cfg_scale, flux.conditioning.negative_prompt, flux.guided) == (
        5.0,
        1.0,
        None,
        False,
    )


def test_abort_and_a_failing_forward_fail_only_their_request(pipelines, monkeypatch) -> None:
    engine = _engine(pipelines["flux"])
    monkeypatch.setenv("OMNI_SERVER_FAULT_PROMPT", "explode")
    from omni_server.engine import fault_injection_hook

    engine._check_fault = fault_injection_hook()
    for name, prompt in (("ok", "a cat"), ("boom", "explode"), ("gone", "a dog")):
        _add(engine, name, prompt=prompt, height=16, width=16, num_inference_steps=2, seed=0)
    engine.abort("gone")
    done = _run(engine)
    assert done["gone"].error is not None and done["gone"].error.kind == "aborted"
    assert done["boom"].error is not None and done["boom"].error.kind == "engine"
    assert done["ok"].error is None and len(done["ok"].outputs) == 1
    assert not engine.has_work()


def test_the_warm_up_compiles_each_graph_serving_needs_once(family_dirs):
    """Issue 24 (cold start): the engine's first warm-up request runs at a served size. At the smallest accepted
    size (16x16: one image token on FLUX.1) dynamo specialized the sequence length to 1, and the one-row request
    at the served size compiled both block classes again: 9 graphs where 7 do (one row: the double-stream block,
    the single-stream block, the VAE decoder; two rows: those again, and the single-stream block once more for its
    strided slices, RESULTS.md 2026-12-02c)."""
    import torch._dynamo

    import omni_models
    from omni_models.compilation import compile_count
    from omni_server.engine import EngineCore

    torch._dynamo.reset()
    try:
        pipeline = omni_models.load(str(family_dirs["flux"]), compile=True, compile_backend="eager")
        before = compile_count()
        EngineCore(pipeline, build_config(None, model="unused", device="cpu"))
        assert compile_count() - before == 7
    finally:
        torch._dynamo.reset()


def test_a_compiled_pipeline_is_warmed_up_at_its_served_shapes_and_serving_then_compiles_nothing(family_dirs):
    """The engine's start-up (a warm-up that compiled graphs, so the served shapes as well) leaves nothing for
    requests of other sizes and row counts to compile: ``recompiles_since_ready`` stays 0 (``/metrics``)."""
    import omni_models
    from omni_server.engine import EngineCore

    pipeline = omni_models.load(str(family_dirs["flux"]), compile=True, compile_backend="eager")
    engine = EngineCore(pipeline, build_config(None, model="unused", device="cpu"))
    ready = engine.stats()
    assert ready.compiled_graphs > 0 and ready.recompiles_since_ready == 0
    _add(engine, "a", prompt="a red circle", height=48, width=48, n=3, num_inference_steps=2, seed=1)
    _add(engine, "b", prompt="a blue square", height=16, width=16, num_inference_steps=2, seed=2)
    done = _run(engine)
    assert sorted(done) == ["a", "b"] and all(o.error is None for o in done.values())
    assert engine.stats().recompiles_since_ready == 0


def test_under_caching_precompile_the_warm_up_saves_the_compiled_functions_in_the_models_cache_directory(
    family_dirs, tmp_path, monkeypatch, caplog
):
    """With a compile cache and torch's caching precompile on (``TORCH_CACHING_PRECOMPILE=1``: opt-in) the engine
    writes what its warm-up compiled (dynamo's precompiled functions) under a directory keyed by the model and its
    load options, and says where the compile time went. (Dynamo's ``eager`` test backend saves no code, so a restart
    compiles again: the inductor round trip is ``tests/omni_models/test_compiled_serving.py``.)"""
    import logging

    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import omni_models
    from omni_server.engine import EngineCore

    # use_compile_cache sets process-wide state: torch's own patches put it back for the tests after this one.
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    try:
        with (
            torch._dynamo.config.patch(caching_precompile=True),
            inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache),
            functorch_config.patch(
                enable_autograd_cache=functorch_config.enable_autograd_cache,
                bundled_autograd_cache=functorch_config.bundled_autograd_cache,
            ),
        ):
            pipeline = omni_models.load(
                str(family_dirs["flux"]), compile=True, compile_backend="eager", compile_cache_dir=tmp_path
            )
            with caplog.at_level(logging.INFO, logger="omni_server.engine"):
                EngineCore(pipeline, build_config(None, model="unused", device="cpu"))
    finally:
        torch._dynamo.reset()
    (scope,) = tmp_path.iterdir()
    assert scope.name.startswith(family_dirs["flux"].name + "-") and any((scope / "dynamo").iterdir())
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compile time by phase (s): _compile.compile_inner") for m in messages)
    assert any(m.startswith("compile cache: ") and "functions saved precompiled" in m for m in messages)


def _row_tokens(pipeline, size: int) -> int:
    """The image tokens of one row at ``size``² (latents of a prepared job)."""
    job = pipeline.prepare(resolve_request(pipeline.info, GenerationRequest(prompt="dog", height=size, width=size)))[0]
    return pipeline.row_tokens(job)


def test_a_forward_batches_at_most_max_batched_image_tokens_and_keeps_a_jobs_cfg_rows_together(
    pipelines, monkeypatch, tools
) -> None:
    """``max_batched_image_tokens``: rows past the budget run in the next forward of the same step, a job's cond
    and uncond rows in one forward, a job over the budget alone, and the VAE decodes in batches within it. A job
    that runs alone under the budget gives the image a batch-invariant run gives, bit for bit; the others match
    the unbounded run."""
    pipeline = pipelines["qwen-image"]
    tokens = _row_tokens(pipeline, 32)
    assert _row_tokens(pipeline, 16) * 4 == tokens
    unguided = dict(negative_prompt="blurry", guidance_scale=1.0)  # guidance 1 turns Qwen-Image's true CFG off
    requests = {
        "cfg": dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, seed=1),  # cond + uncond
        "two": dict(prompt="a blue square", height=32, width=32, n=2, num_inference_steps=2, seed=2, **unguided),
        "small": dict(prompt="dog", height=16, width=16, n=3, num_inference_steps=2, seed=3),  # 3 x 2 rows
    }
    forwards = Counter(monkeypatch, pipeline.backend, "forward")
    decodes = Counter(monkeypatch, pipeline.backend, "decode")

    def run(budget: int, **config) -> dict[str, list[bytes]]:
        monkeypatch.setattr(pipeline, "max_batched_image_tokens", budget)
        engine = _engine(pipeline, max_rows_per_step=0, **config)
        for name, fields in requests.items():
            _add(engine, name, **fields)
        done = _run(engine)
        assert sorted(done) == sorted(requests) and all(o.error is None for o in done.values())
        return {name: o.outputs for name, o in done.items()}

    unbounded = run(0)
    assert forwards.calls == [4, 6] * 2 and sorted(decodes.calls) == [3, 3]
    invariant = run(0, batch_invariant=True)
    forwards.calls.clear(), decodes.calls.clear()
    run(2 * tokens)
    # Per step at 32x32: cfg's 2 rows fill the budget, then two's 2 rows; at 16x16 small's 6 rows are 1.5 of it.
    assert forwards.calls == [2, 2, 6] * 2
    assert sorted(decodes.calls) == [1, 2, 3]  # 32x32: cfg and two's first, then two's second; 16x16: all 3
    forwards.calls.clear(), decodes.calls.clear()
    bounded = run(tokens)
    assert forwards.calls == [2, 1, 1, 4, 2] * 2  # cfg alone over the budget, two's rows one by one, small 2 + 1
    assert sorted(decodes.calls) == [1, 1, 1, 3]
    assert bounded["cfg"] == invariant["cfg"] and bounded["two"] == invariant["two"]
    for name in requests:
        for image, reference in zip(bounded[name], unbounded[name], strict=True):
            assert tools.psnr(*(Image.open(io.BytesIO(b)) for b in (image, reference))) >= 40.0, name


def test_the_forward_token_budget_is_checked_and_only_the_families_take_it() -> None:
    """A negative budget is refused before anything loads; the DiT refuses it by name."""
    import omni_models
    from omni_models import load

    with pytest.raises(ValueError, match="max_batched_image_tokens must be >= 0"):
        load("omni-shapes-tiny", max_batched_image_tokens=-1)
    with pytest.raises(ValueError, match="max_batched_image_tokens applies to the diffusers families"):
        load("omni-shapes-tiny", max_batched_image_tokens=64)
    assert omni_models.inspect("omni-shapes-tiny").capabilities.batched_image_tokens is False


def test_at_one_row_per_forward_the_warm_up_compiles_only_one_row_graphs(family_dirs):
    """Issue 24 (cold start): with the budget at one row of the served size, the warm-up's two-image request runs
    its rows one per forward and compiles nothing: 3 graphs (the double-stream block, the single-stream block, the
    VAE decoder) where 7 compile without it; concurrent requests at that size then compile nothing either."""
    import torch._dynamo

    import omni_models
    from omni_models.compilation import compile_count
    from omni_server.engine import EngineCore

    torch._dynamo.reset()
    try:
        pipeline = omni_models.load(str(family_dirs["flux"]), compile=True, compile_backend="eager")
        height, width = pipeline.info.image.smallest_listed_size()
        budget = _row_tokens(pipeline, height)
        pipeline.max_batched_image_tokens = budget
        before = compile_count()
        engine = EngineCore(pipeline, build_config(None, model="unused", device="cpu"))
        assert compile_count() - before == 3
        _add(engine, "a", prompt="a red circle", height=height, width=width, n=2, num_inference_steps=2, seed=1)
        _add(engine, "b", prompt="a blue square", height=height, width=width, num_inference_steps=2, seed=2)
        done = _run(engine)
        assert sorted(done) == ["a", "b"] and all(o.error is None for o in done.values())
        assert engine.stats().recompiles_since_ready == 0
    finally:
        torch._dynamo.reset()
