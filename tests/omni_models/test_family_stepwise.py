"""The families' stepwise, batched API: what an engine relies on (one forward per size, text encoded once per
request, batched decode, per-job steps and guidance), request validation and the description in ``info``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omni_models
from omni_models import FamilyPipeline, GenerationRequest, InvalidRequestError, resolve_request

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def flux(flux_dev_dir) -> FamilyPipeline:
    return omni_models.load(str(flux_dev_dir), max_sequence_length=16)


@pytest.fixture(scope="module")
def qwen(qwen_image_dir) -> FamilyPipeline:
    return omni_models.load(str(qwen_image_dir))


def _forward_batches(pipe: FamilyPipeline) -> tuple[list[int], object]:
    sizes: list[int] = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    return sizes, handle


def _jobs(pipe: FamilyPipeline, **fields) -> list:
    """The jobs of one request, checked as every entry point checks it."""
    return pipe.prepare(resolve_request(pipe.info, GenerationRequest(**fields)))


def _run_alone(pipe: FamilyPipeline, **request) -> torch.Tensor:
    (job,) = _jobs(pipe, **request)
    pipe.start([job])
    while not job.finished:
        pipe.step([job])
    return job.latents


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_jobs_at_different_steps_sizes_and_guidance_share_forwards(family, request):
    pipe = request.getfixturevalue(family)
    if family == "flux":
        a = dict(prompt="a red circle", guidance_scale=2.0, num_inference_steps=4, seed=1, height=16, width=16)
        b = dict(
            prompt="a blue dog",
            negative_prompt="bad",
            true_cfg_scale=2.0,
            guidance_scale=4.0,
            num_inference_steps=3,
            seed=2,
            height=16,
            width=16,
        )
        c = dict(prompt="a cat", guidance_scale=3.5, num_inference_steps=2, seed=3, height=16, width=32)
    else:
        a = dict(prompt="a red circle", negative_prompt=None, num_inference_steps=4, seed=1, height=16, width=16)
        b = dict(
            prompt="a blue dog at night",
            negative_prompt="bad",
            true_cfg_scale=3.0,
            num_inference_steps=3,
            seed=2,
            height=16,
            width=16,
        )
        c = dict(
            prompt="a cat",
            negative_prompt="blurry photo",
            true_cfg_scale=5.0,
            num_inference_steps=2,
            seed=3,
            height=16,
            width=24,
        )
    expected = [_run_alone(pipe, **r) for r in (a, b, c)]
    (job_a,), (job_b,), (job_c,) = (_jobs(pipe, **r) for r in (a, b, c))
    pipe.start([job_a, job_b, job_c])
    sizes, handle = _forward_batches(pipe)
    try:
        pipe.step([job_a])  # a is one step ahead of b and c from here on
        assert sizes == [1]
        sizes.clear()
        pipe.step([job_a, job_b, job_c])  # a (1 row) + b (cond, uncond) share one forward; c its own
        assert sorted(sizes) == [1 + job_c.guided, 3]
        while not all(job.finished for job in (job_a, job_b, job_c)):
            pipe.step([job for job in (job_a, job_b, job_c) if not job.finished])
    finally:
        handle.remove()
    assert (job_a.step_index, job_b.step_index, job_c.step_index) == (4, 3, 2)
    for job, alone in zip((job_a, job_b, job_c), expected, strict=True):
        torch.testing.assert_close(job.latents, alone, rtol=1e-4, atol=1e-4)


def test_text_encoders_run_once_per_request_and_once_per_distinct_text(flux):
    calls: list[int] = []
    handle = flux.backend.pipeline.text_encoder_2.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        jobs = _jobs(
            flux,
            prompt="a fox",
            negative_prompt="bad",
            true_cfg_scale=2.0,
            n=3,
            seed=5,
            num_inference_steps=2,
            height=16,
            width=16,
        )
        assert len({id(job.conditioning) for job in jobs}) == 1 and [j.request.seed for j in jobs] == [5, 6, 7]
        flux.start(jobs)
        assert len(calls) == 2  # the prompt and the negative prompt, for all three images
        flux.start(jobs)
        assert len(calls) == 2  # encoded conditionings are not encoded again
        other = _jobs(flux, prompt="a fox", num_inference_steps=2, height=16, width=16) + _jobs(
            flux, prompt="a fox", num_inference_steps=2, height=16, width=16
        )
        flux.start(other)
        assert len(calls) == 3  # two requests with the same text in one call: encoded once
    finally:
        handle.remove()


def test_decode_is_one_vae_call_per_size_and_equals_single_decodes(flux, monkeypatch):
    requests = [dict(seed=s, height=h, width=w) for s, (h, w) in enumerate([(16, 16), (16, 32), (16, 16)])]
    jobs = [job for r in requests for job in _jobs(flux, prompt="a cat", num_inference_steps=1, **r)]
    flux.start(jobs)
    flux.step(jobs)
    vae = flux.backend.pipeline.vae
    calls: list[int] = []
    decode = vae.decode
    monkeypatch.setattr(vae, "decode", lambda z, **kw: (calls.append(z.shape[0]), decode(z, **kw))[1])
    images = flux.decode(jobs)
    assert sorted(calls) == [1, 2]
    assert [image.size for image in images] == [(16, 16), (32, 16), (16, 16)]
    for job, image in zip(jobs, images, strict=True):
        assert np.array_equal(np.asarray(image), np.asarray(flux.decode([job])[0]))


def test_image_i_of_a_request_uses_seed_plus_i_and_steps_are_observable(flux, psnr):
    seen: list[int] = []
    pair = flux(
        "a red circle",
        seed=40,
        num_images_per_prompt=2,
        num_inference_steps=2,
        height=16,
        width=16,
        callback_on_step_end=lambda pipe, step, t, tensors: seen.append(tensors["latents"].shape[0]),
    )
    assert seen == [2, 2]
    second = flux("a red circle", seed=41, num_inference_steps=2, height=16, width=16)[0]
    assert psnr(pair[1], second) > 40


def test_batches_that_break_the_contract_are_refused(flux):
    (job,) = _jobs(flux, prompt="a cat", num_inference_steps=1, height=16, width=16)
    with pytest.raises(ValueError, match=r"start\(\) must run"):
        flux.step([job])
    flux.start([job])
    with pytest.raises(ValueError, match="appears twice"):
        flux.step([job, job])
    with pytest.raises(ValueError, match="decode needs a finished job"):
        flux.decode([job])
    flux.step([job])
    with pytest.raises(ValueError, match="already ran all 1 steps"):
        flux.step([job])
    with pytest.raises(ValueError, match="the batch is empty"):
        flux.step([])


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"prompt": ""}, "prompt", "non-empty string"),
        ({"negative_prompt": 3}, "negative_prompt", "string or None"),
        # The tiny checkpoint's VAE is 32 pixels: sizes are multiples of 2 up to twice that.
        (
            {"height": 17},
            "size",
            "size 32x17 is not supported by flux.1-dev: width and height must be multiples of 2 in [2, 64]",
        ),
        (
            {"width": 66},
            "size",
            "size 66x32 is not supported by flux.1-dev: width and height must be multiples of 2 in [2, 64]",
        ),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 1000]"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "finite number"),
        ({"true_cfg_scale": -1.0}, "true_cfg_scale", "finite number"),
        ({"seed": 2**63 - 2, "n": 3}, "seed", f"[0, {2**63 - 1 - 2}]"),
        ({"n": 0}, "n", "[1, 10]"),
    ],
)
def test_bad_requests_name_the_field(flux, kwargs, param, fragment):
    with pytest.raises(InvalidRequestError, match=fragment.replace("[", r"\[").replace("*", r"\*")) as error:
        _jobs(flux, **{"prompt": "a cat", **kwargs})
    assert error.value.param == param


def test_info_describes_what_the_family_accepts(flux, qwen):
    info, image = flux.info, flux.info.image
    rule = image.size_range
    # The default side is the VAE's own sample size (32 in this tiny checkpoint), the largest twice that.
    assert (info.family, rule.multiple, rule.min_side, rule.max_side) == ("flux", 2, 2, 64)
    assert (image.default_size, image.default_steps) == ((32, 32), 28)
    assert (image.guidance, image.default_guidance_scale, image.true_cfg, image.default_true_cfg_scale) == (
        "embedded",
        3.5,
        True,
        1.0,
    )
    assert "negative_prompt" in info.accepts and image.max_prompt_tokens == 16 and image.max_images_per_request == 10
    qwen_image = qwen.info.image
    assert (qwen_image.size_range.multiple, qwen_image.size_range.max_side, qwen_image.default_steps) == (8, 1024, 50)
    # Qwen-Image has no embedded guidance: its guidance_scale is the true-CFG scale.
    assert qwen_image.guidance == "true-cfg" and qwen_image.default_guidance_scale == 4.0
    (job,) = _jobs(qwen, prompt="a cat", negative_prompt="bad")
    assert job.guided and job.request.true_cfg_scale == job.true_cfg_scale == 4.0 and job.size == (512, 512)
