"""The families' stepwise, batched API: what an engine relies on (one forward per size, text encoded once per
request, batched decode, per-job steps and guidance), request validation and the description in ``info``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omni_models
from omni_models import FamilyPipeline, InvalidRequestError

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
        lambda module, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    return sizes, handle


def _run_alone(pipe: FamilyPipeline, **request) -> torch.Tensor:
    (job,) = pipe.prepare(**request)
    pipe.encode_prompts([job])
    while not job.finished:
        pipe.run_denoise_step([job])
    return job.latents


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_jobs_at_different_steps_sizes_and_guidance_share_forwards(family, request):
    pipe = request.getfixturevalue(family)
    if family == "flux":
        a = dict(prompt="a red circle", guidance_scale=2.0, num_inference_steps=4, seed=1, height=16, width=16)
        b = dict(prompt="a blue dog", negative_prompt="bad", true_cfg_scale=2.0, guidance_scale=4.0,
                 num_inference_steps=3, seed=2, height=16, width=16)
        c = dict(prompt="a cat", guidance_scale=3.5, num_inference_steps=2, seed=3, height=16, width=32)
    else:
        a = dict(prompt="a red circle", num_inference_steps=4, seed=1, height=16, width=16)
        b = dict(prompt="a blue dog at night", negative_prompt="bad", true_cfg_scale=3.0, num_inference_steps=3,
                 seed=2, height=16, width=16)
        c = dict(prompt="a cat", negative_prompt="blurry photo", true_cfg_scale=5.0, num_inference_steps=2, seed=3,
                 height=16, width=24)
    expected = [_run_alone(pipe, **r) for r in (a, b, c)]
    (job_a,), (job_b,), (job_c,) = (pipe.prepare(**r) for r in (a, b, c))
    pipe.encode_prompts([job_a, job_b, job_c])
    sizes, handle = _forward_batches(pipe)
    try:
        pipe.run_denoise_step([job_a])                # a is one step ahead of b and c from here on
        assert sizes == [1]
        sizes.clear()
        pipe.run_denoise_step([job_a, job_b, job_c])  # a (1 row) + b (cond, uncond) share one forward; c its own
        assert sorted(sizes) == [1 + job_c.guided, 3]
        while not all(job.finished for job in (job_a, job_b, job_c)):
            pipe.run_denoise_step([job for job in (job_a, job_b, job_c) if not job.finished])
    finally:
        handle.remove()
    assert (job_a.step_index, job_b.step_index, job_c.step_index) == (4, 3, 2)
    for job, alone in zip((job_a, job_b, job_c), expected):
        torch.testing.assert_close(job.latents, alone, rtol=1e-4, atol=1e-4)


def test_text_encoders_run_once_per_request_and_once_per_distinct_text(flux):
    calls: list[int] = []
    handle = flux.backend.pipeline.text_encoder_2.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        jobs = flux.prepare("a fox", negative_prompt="bad", true_cfg_scale=2.0, num_images=3, seed=5,
                            num_inference_steps=2, height=16, width=16)
        assert len({id(job.conditioning) for job in jobs}) == 1 and [j.request.seed for j in jobs] == [5, 6, 7]
        flux.encode_prompts(jobs)
        assert len(calls) == 2          # the prompt and the negative prompt, for all three images
        flux.encode_prompts(jobs)
        assert len(calls) == 2          # encoded conditionings are not encoded again
        other = flux.prepare("a fox", num_inference_steps=2, height=16, width=16) + \
            flux.prepare("a fox", num_inference_steps=2, height=16, width=16)
        flux.encode_prompts(other)
        assert len(calls) == 3          # two requests with the same text in one call: encoded once
    finally:
        handle.remove()


def test_decode_is_one_vae_call_per_size_and_equals_single_decodes(flux, monkeypatch):
    requests = [dict(seed=s, height=h, width=w) for s, (h, w) in enumerate([(16, 16), (16, 32), (16, 16)])]
    jobs = [job for r in requests for job in flux.prepare("a cat", num_inference_steps=1, **r)]
    flux.encode_prompts(jobs)
    flux.run_denoise_step(jobs)
    vae = flux.backend.pipeline.vae
    calls: list[int] = []
    decode = vae.decode
    monkeypatch.setattr(vae, "decode", lambda z, **kw: (calls.append(z.shape[0]), decode(z, **kw))[1])
    images = flux.decode(jobs)
    assert sorted(calls) == [1, 2]
    assert [image.size for image in images] == [(16, 16), (32, 16), (16, 16)]
    for job, image in zip(jobs, images):
        assert np.array_equal(np.asarray(image), np.asarray(flux.decode([job])[0]))


def test_image_i_of_a_request_uses_seed_plus_i_and_steps_are_observable(flux, psnr):
    seen: list[int] = []
    pair = flux("a red circle", seed=40, num_images_per_prompt=2, num_inference_steps=2, height=16, width=16,
                callback_on_step_end=lambda pipe, step, t, tensors: seen.append(tensors["latents"].shape[0]))
    assert seen == [2, 2]
    second = flux("a red circle", seed=41, num_inference_steps=2, height=16, width=16)[0]
    assert psnr(pair[1], second) > 40


def test_batches_that_break_the_contract_are_refused(flux):
    (job,) = flux.prepare("a cat", num_inference_steps=1, height=16, width=16)
    with pytest.raises(ValueError, match="encode_prompts must run"):
        flux.run_denoise_step([job])
    flux.encode_prompts([job])
    with pytest.raises(ValueError, match="appears twice"):
        flux.run_denoise_step([job, job])
    with pytest.raises(ValueError, match="decode needs a finished job"):
        flux.decode([job])
    flux.run_denoise_step([job])
    with pytest.raises(ValueError, match="already ran all 1 steps"):
        flux.run_denoise_step([job])
    with pytest.raises(ValueError, match="the batch is empty"):
        flux.run_denoise_step([])


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"prompt": ""}, "prompt", "non-empty string"),
        ({"negative_prompt": 3}, "negative_prompt", "string or None"),
        ({"height": 17}, "height", "multiple of 2 in [2, 256]"),
        ({"width": 258}, "width", "multiple of 2 in [2, 256]"),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 1000]"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "finite number"),
        ({"true_cfg_scale": -1.0}, "true_cfg_scale", "finite number"),
        ({"seed": 2**63 - 2, "num_images": 3}, "seed", "2**63 - 1 - 2"),
        ({"num_images": 0}, "n", "[1, 16]"),
    ],
)
def test_bad_requests_name_the_field(flux, kwargs, param, fragment):
    with pytest.raises(InvalidRequestError, match=fragment.replace("[", r"\[").replace("*", r"\*")) as error:
        flux.prepare(**{"prompt": "a cat", **kwargs})
    assert error.value.param == param


def test_info_describes_what_the_family_accepts(flux, qwen):
    info = flux.info
    assert (info.family, info.pixel_multiple, info.min_side, info.max_side) == ("flux", 2, 2, 256)
    assert (info.default_height, info.default_width, info.default_steps) == (128, 128, 28)
    assert (info.embedded_guidance, info.default_guidance_scale, info.true_cfg, info.default_true_cfg_scale) == (
        True, 3.5, True, 1.0)
    assert info.negative_prompt and info.max_sequence_length == 16 and info.max_images_per_request == 16
    assert (qwen.info.pixel_multiple, qwen.info.max_side, qwen.info.default_steps) == (8, 1024, 50)
    assert not qwen.info.embedded_guidance and qwen.info.default_guidance_scale is None
    (job,) = qwen.prepare("a cat", negative_prompt="bad")
    assert job.guided and job.request.true_cfg_scale == 4.0 and job.size == (512, 512)
