"""omni's FLUX.1 / Qwen-Image pipelines against diffusers' own pipelines on the same checkpoint and seed (fp32, CPU).

Target: every image at PSNR >= 40 dB against diffusers' image for ``generator=torch.Generator("cpu").manual_seed``
of the same seed. omni batches all images and CFG rows of a call into one forward (ragged prompts for Qwen-Image),
while diffusers runs each image alone, so this also checks that batching changes nothing that shows.
"""

from __future__ import annotations

import pytest
import torch

import omni_models
from omni_models import GenerationRequest, resolve_request

diffusers = pytest.importorskip("diffusers")

TARGET_DB = 40.0


def _compare(psnr, omni_images, reference, cases) -> list[float]:
    figures = []
    for image, (seed, kwargs) in zip(omni_images, cases, strict=True):
        expected = reference(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images[0]
        figures.append(psnr(image, expected))
    print(f"PSNR vs diffusers: min {min(figures):.1f} dB over {len(figures)} images ({figures})")
    assert min(figures) >= TARGET_DB
    return figures


@pytest.fixture(scope="module")
def flux_reference(flux_dev_dir):
    return diffusers.FluxPipeline.from_pretrained(str(flux_dev_dir), dtype=torch.float32)


def test_flux_dev_matches_diffusers_with_embedded_guidance_and_true_cfg(flux_dev_dir, flux_reference, psnr):
    pipe = omni_models.load(str(flux_dev_dir), max_sequence_length=24)
    assert isinstance(pipe, omni_models.FamilyPipeline) and pipe.info.variant == "flux.1-dev"
    common = dict(num_inference_steps=4, height=32, width=48)
    reference_common = dict(common, max_sequence_length=24)
    # Embedded guidance only (one row per image), two images per prompt, seeds 11 and 12.
    plain = pipe("a red circle at the top left", guidance_scale=2.5, seed=11, num_images_per_prompt=2, **common)
    _compare(
        psnr,
        plain,
        flux_reference,
        [
            (11 + i, dict(prompt="a red circle at the top left", guidance_scale=2.5, **reference_common))
            for i in range(2)
        ],
    )
    # True CFG with a negative prompt: cond and uncond rows of both prompts share one forward.
    prompts, negatives = ["a blue square", "a photo of a cat in the snow"], ["bad quality", "blurry"]
    guided = pipe(prompts, negative_prompt=negatives, true_cfg_scale=3.0, guidance_scale=1.5, seed=5, **common)
    _compare(
        psnr,
        guided,
        flux_reference,
        [
            (5 + i, dict(prompt=p, negative_prompt=n, true_cfg_scale=3.0, guidance_scale=1.5, **reference_common))
            for i, (p, n) in enumerate(zip(prompts, negatives, strict=True))
        ],
    )


def test_flux_schnell_has_no_embedded_guidance_and_matches_diffusers(flux_schnell_dir, psnr):
    pipe = omni_models.load(str(flux_schnell_dir))
    info = pipe.info
    # Without embedded guidance, guidance_scale is schnell's true-CFG scale (default 1: no CFG).
    assert (
        info.variant,
        info.image.guidance == "embedded",
        info.image.default_guidance_scale,
        info.image.default_steps,
    ) == ("flux.1-schnell", False, 1.0, 4)
    assert info.image.max_prompt_tokens == 256
    (job,) = pipe.prepare(
        resolve_request(info, GenerationRequest(prompt="a cat", negative_prompt="bad", guidance_scale=3.5))
    )
    assert (job.guidance, job.true_cfg_scale, job.guided) == (None, 3.5, True)
    with pytest.raises(omni_models.InvalidRequestError, match="has no embedded guidance") as error:
        resolve_request(info, GenerationRequest(prompt="a cat", guidance_scale=3.5, true_cfg_scale=2.0))
    assert error.value.param == "guidance_scale"
    reference = diffusers.FluxPipeline.from_pretrained(str(flux_schnell_dir), dtype=torch.float32)
    images = pipe("a green triangle", num_inference_steps=2, seed=3, height=16, width=16)
    _compare(
        psnr,
        images,
        reference,
        [(3, dict(prompt="a green triangle", num_inference_steps=2, height=16, width=16, max_sequence_length=256))],
    )


def test_qwen_image_matches_diffusers_with_true_cfg_and_ragged_prompts(qwen_image_dir, psnr):
    pipe = omni_models.load(str(qwen_image_dir))
    info = pipe.info
    assert (
        info.family,
        info.image.guidance == "embedded",
        info.image.default_true_cfg_scale,
        info.image.size_range.multiple,
    ) == ("qwen-image", False, 4.0, 8)
    reference = diffusers.QwenImagePipeline.from_pretrained(str(qwen_image_dir), dtype=torch.float32)
    # Prompts and negative prompts of four different token lengths: 4 ragged rows in one forward.
    prompts = ["a red circle on a blue background", "dog"]
    negatives = ["bad quality", "a blurry photo of a cat at night"]
    images = pipe(
        prompts, negative_prompt=negatives, true_cfg_scale=4.0, num_inference_steps=3, seed=21, height=32, width=48
    )
    cases = [
        (21 + j, dict(prompt=p, negative_prompt=n, true_cfg_scale=4.0, num_inference_steps=3, height=32, width=48))
        for j, (p, n) in enumerate(zip(prompts, negatives, strict=True))
    ]
    _compare(psnr, images, reference, cases)
    # Without a negative prompt there is no true CFG, as in diffusers (one row per image).
    jobs = pipe.prepare(
        resolve_request(info, GenerationRequest(prompt="a cat", negative_prompt=None, true_cfg_scale=4.0))
    )
    assert not jobs[0].guided
    # A request naming none gets the model's default negative prompt, " ", so its default true CFG applies.
    (job,) = pipe.prepare(resolve_request(info, GenerationRequest(prompt="a cat")))
    assert (job.guided, job.conditioning.negative_prompt, job.true_cfg_scale) == (True, " ", 4.0)
    plain = pipe("a white diamond", num_inference_steps=2, seed=4, height=16, width=16)
    _compare(psnr, plain, reference, [(4, dict(prompt="a white diamond", num_inference_steps=2, height=16, width=16))])
