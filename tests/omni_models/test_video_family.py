"""The Wan video family (``omni_models.backends.wan``) against diffusers' own ``WanPipeline`` (fp32, CPU).

Targets: every video's frames at PSNR >= 40 dB against diffusers' frames for
``generator=torch.Generator("cpu").manual_seed`` of the same seed, for tiny random Wan2.1 and Wan2.2-A14B
checkpoints written here; jobs of different prompts in one forward equal each alone; a job's progress is its
step index; bad requests and checkpoints fail with errors that name what to change.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import omni_models
from omni_models import CheckpointError, GenerationRequest, InvalidRequestError, Video, resolve_request

diffusers = pytest.importorskip("diffusers")

TARGET_DB = 40.0
SHAPE = dict(height=32, width=48, num_frames=5, num_inference_steps=4)


def video_psnr(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


def diffusers_frames(reference, seed: int, **kwargs) -> np.ndarray:
    frames = reference(generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]
    return Video.from_float(frames, 16).frames


@pytest.fixture(scope="module")
def wan21(wan21_dir):
    return omni_models.load(str(wan21_dir))


@pytest.fixture(scope="module")
def wan21_reference(wan21_dir):
    return diffusers.WanPipeline.from_pretrained(str(wan21_dir), dtype=torch.float32)


def test_wan21_matches_diffusers_and_batched_prompts_equal_each_alone(wan21, wan21_reference):
    pipe = wan21
    assert isinstance(pipe, omni_models.VideoFamilyPipeline)
    assert (pipe.info.task, pipe.info.family, pipe.info.variant) == ("text-to-video", "wan", "wan2.1")
    prompts, negatives = ["a red fox in the snow", "a blue square at night"], ["blurry", None]
    # Both prompts' cond and uncond rows (4 rows) in one transformer forward per step.
    videos = pipe(prompts, negative_prompt=negatives, guidance_scale=5.0, seed=7, fps=8, **SHAPE)
    assert [v.frames.shape for v in videos] == [(5, 32, 48, 3)] * 2 and [v.fps for v in videos] == [8, 8]
    assert all(v.frames.std() > 5 for v in videos)  # frames with content, not a constant
    figures = []
    for i, (prompt, negative) in enumerate(zip(prompts, negatives, strict=True)):
        expected = diffusers_frames(
            wan21_reference, 7 + i, prompt=prompt, negative_prompt=negative, guidance_scale=5.0, **SHAPE
        )
        figures.append(video_psnr(videos[i].frames, expected))
        alone = pipe(prompt, negative_prompt=negative, guidance_scale=5.0, seed=7 + i, fps=8, **SHAPE)[0]
        figures.append(video_psnr(videos[i].frames, alone.frames))
    print(f"PSNR vs diffusers / batched vs alone: {figures}")
    assert min(figures) >= TARGET_DB
    assert not np.array_equal(videos[0].frames, videos[1].frames)
    # Without CFG (guidance 1): one row per video, still diffusers' frames.
    plain = pipe("a red fox in the snow", guidance_scale=1.0, seed=3, **SHAPE)[0]
    assert (
        video_psnr(
            plain.frames,
            diffusers_frames(wan21_reference, 3, prompt="a red fox in the snow", guidance_scale=1.0, **SHAPE),
        )
        >= TARGET_DB
    )


def test_wan22_a14b_switches_experts_at_the_boundary_like_diffusers(wan22_a14b_dir):
    pipe = omni_models.load(str(wan22_a14b_dir))
    video = pipe.info.video
    assert (pipe.info.variant, video.experts, video.boundary_ratio) == ("wan2.2-a14b", 2, 0.875)
    assert "guidance_scale_2" in pipe.info.accepts
    resolved = resolve_request(pipe.info, GenerationRequest(prompt="a cat", seed=1, **SHAPE))
    (job,) = pipe.prepare(resolved)
    assert job.experts == (0, 0, 1, 1)  # 4 UniPC steps at shift 3: two above 875, two below
    assert job.scales == (4.0, 3.0)  # the model card's defaults when the request names neither
    # guidance_scale given, guidance_scale_2 not: diffusers' rule, the same scale for both experts.
    resolved = resolve_request(pipe.info, GenerationRequest(prompt="a cat", guidance_scale=6.0, **SHAPE))
    assert resolved.guidance_scale_2 == 6.0
    reference = diffusers.WanPipeline.from_pretrained(str(wan22_a14b_dir), dtype=torch.float32)
    kwargs = dict(prompt="a red fox in the snow", guidance_scale=5.0, guidance_scale_2=2.0, **SHAPE)
    ours = pipe(seed=11, **kwargs)[0]
    figure = video_psnr(ours.frames, diffusers_frames(reference, 11, **kwargs))
    # The second expert matters: the same call with another low-noise scale differs.
    other = pipe(seed=11, **{**kwargs, "guidance_scale_2": 6.0})[0]
    print(f"Wan2.2 A14B PSNR vs diffusers: {figure:.1f} dB")
    assert figure >= TARGET_DB
    assert video_psnr(ours.frames, other.frames) < TARGET_DB


def test_stepwise_jobs_at_different_steps_and_experts_share_a_step_call(wan22_a14b_dir, wan21):
    pipe = omni_models.load(str(wan22_a14b_dir))
    request = GenerationRequest(prompt="a red fox", seed=5, guidance_scale=5.0, **SHAPE)
    first = pipe.prepare(resolve_request(pipe.info, request), request_id="a")
    second = pipe.prepare(resolve_request(pipe.info, msgspec_replace(request, prompt="a blue square")))
    pipe.start(first + second)
    pipe.step(first)
    pipe.step(first)  # first is now at step 2 (the low-noise expert); second at 0 (the high-noise one)
    assert [first[0].step_index, first[0].expert, second[0].expert] == [2, 1, 0]
    pipe.step(first + second)  # two forwards: one per expert
    while not second[0].finished:
        pipe.step([j for j in first + second if not j.finished])
    assert (first[0].step_index, first[0].num_steps) == (4, 4)
    videos = pipe.decode(first + second)
    alone = pipe(prompt="a blue square", seed=5, guidance_scale=5.0, **SHAPE)[0]
    assert video_psnr(videos[1].frames, alone.frames) >= TARGET_DB
    pipe.release(first + second)
    pipe.release(first)  # twice is allowed
    assert first[0].scheduler is None and first[0].conditioning.cond is None
    with pytest.raises(ValueError, match="decode needs a finished job"):
        pipe.decode(wan21.prepare(resolve_request(wan21.info, GenerationRequest(prompt="x", **SHAPE))))


def msgspec_replace(request: GenerationRequest, **changes) -> GenerationRequest:
    import msgspec

    return msgspec.structs.replace(request, **changes)


def test_video_requests_are_checked_once_and_image_models_refuse_video_fields(wan21_dir, flux_schnell_dir):
    spec = omni_models.inspect(str(wan21_dir))
    info = spec.info
    assert spec.kind == "wan" and not spec.capabilities.lora and not spec.capabilities.compile
    # A tiny checkpoint's defaults are small; the released ones' are 832x480, 81 frames at 16 fps.
    resolved = resolve_request(info, GenerationRequest(prompt="a cat"))
    assert (resolved.width, resolved.height, resolved.num_frames, resolved.fps) == (64, 64, 9, 16)
    assert (resolved.num_inference_steps, resolved.guidance_scale, resolved.guidance_scale_2) == (4, 5.0, None)
    bad = [
        (dict(num_frames=6), "num_frames", r"4k\+1"),
        (dict(num_frames=0), "num_frames", r"4k\+1"),
        (dict(num_frames=True), "num_frames", "integer"),
        (dict(fps=0), "fps", r"\[1, 60\]"),
        (dict(width=40, height=32), "size", "multiples of 16"),
        (dict(guidance_scale_2=2.0), "guidance_scale_2", "does not use guidance_scale_2"),
        (dict(true_cfg_scale=2.0), "true_cfg_scale", "does not use true_cfg_scale"),
        (dict(cache="fast"), "cache", "does not use cache"),
        (dict(n=5), "n", r"\[1, 4\]"),
    ]
    for fields, param, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            resolve_request(info, GenerationRequest(prompt="a cat", **fields))
        assert caught.value.param == param, fields
    image_info = omni_models.inspect(str(flux_schnell_dir)).info
    for field in ("num_frames", "fps", "guidance_scale_2"):
        with pytest.raises(InvalidRequestError, match=f"does not use {field}") as caught:
            resolve_request(image_info, GenerationRequest(prompt="a cat", **{field: 5}))
        assert caught.value.param == field
    assert resolve_request(image_info, GenerationRequest(prompt="a cat")).num_frames == 0


def test_wan_checkpoint_problems_are_named_before_loading(wan21_dir, wan22_a14b_dir, tmp_path):
    def copy_with_index(source, name, change):
        target = tmp_path / name
        shutil.copytree(source, target)
        index = json.loads((target / "model_index.json").read_text())
        change(index)
        (target / "model_index.json").write_text(json.dumps(index))
        return target

    half = copy_with_index(wan21_dir, "boundary-only", lambda index: index.update(boundary_ratio=0.9))
    with pytest.raises(CheckpointError, match="boundary_ratio without transformer_2"):
        omni_models.inspect(str(half))
    lone = copy_with_index(wan22_a14b_dir, "expert-only", lambda index: index.update(boundary_ratio=None))
    with pytest.raises(CheckpointError, match="transformer_2 without boundary_ratio"):
        omni_models.inspect(str(lone))
    unknown = copy_with_index(wan21_dir, "setting", lambda index: index.update(frame_interpolation=2))
    with pytest.raises(CheckpointError, match="frame_interpolation=2 is a WanPipeline setting omni does not support"):
        omni_models.load(str(unknown))
    with pytest.raises(ValueError, match="lora, compile: not supported by the wan family"):
        omni_models.load(str(wan21_dir), lora=omni_models.LoRAOptions(max_loras=1, max_rank=4), compile=True)
