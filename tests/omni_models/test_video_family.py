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
    assert spec.kind == "wan" and not spec.capabilities.lora and spec.capabilities.compile
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
        (dict(cache="sometimes"), "cache", "one of the presets off, safe, fast"),
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
    with pytest.raises(ValueError, match="lora: not supported by the wan family"):
        omni_models.load(str(wan21_dir), lora=omni_models.LoRAOptions(max_loras=1, max_rank=4))


def test_wan22_ti2v_text_to_video_matches_diffusers(wan22_ti2v_dir):
    """TI2V-5B's layout: one timestep per latent token (expand_timesteps), a 48-channel VAE with 16x compression."""
    pipe = omni_models.load(str(wan22_ti2v_dir))
    info = pipe.info
    assert (info.variant, info.image.size_range.multiple, info.video.default_fps) == ("wan2.2-ti2v", 32, 24)
    kwargs = dict(
        prompt="a red fox in the snow", guidance_scale=5.0, height=64, width=32, num_frames=5, num_inference_steps=3
    )
    ours = pipe(seed=2, **kwargs)[0]
    reference = diffusers.WanPipeline.from_pretrained(str(wan22_ti2v_dir), dtype=torch.float32)
    figure = video_psnr(ours.frames, diffusers_frames(reference, 2, **kwargs))
    print(f"Wan2.2 TI2V PSNR vs diffusers: {figure:.1f} dB")
    assert figure >= TARGET_DB and ours.fps == 24


def test_vae_decode_tiles_only_frames_beyond_720p_as_diffusers_tiles(wan21, monkeypatch):
    """Memory stays bounded: AutoencoderKLWan decodes one latent frame at a time and omni one video at a time.
    Frames of up to ``UNTILED_MAX_PIXELS`` (1280x720) decode whole, as ``WanPipeline`` decodes by default; larger
    ones go through diffusers' spatial tiling (its own ``enable_tiling`` tiles, which leave frames of at most 256
    pixels a side untouched). The threshold is lowered here so that a CPU-sized frame crosses it."""
    from omni_models.backends import wan

    latents = torch.randn((16, 2, 2, 40), generator=torch.Generator().manual_seed(0))  # 5 frames of 16x320 pixels
    whole = wan21.backend.decode_video(latents)
    assert whole.shape == (5, 16, 320, 3) and not wan21.backend.pipeline.vae.use_tiling
    monkeypatch.setattr(wan, "UNTILED_MAX_PIXELS", 16 * 64)
    tiled = wan21.backend.decode_video(latents)
    assert wan21.backend.pipeline.vae.use_tiling
    assert not np.array_equal(tiled, whole)  # the tiles really ran (their blended seams differ)
    small = wan21.backend.decode_video(latents[..., :8])  # 16x64 pixels: at the threshold, decoded whole
    monkeypatch.undo()
    assert np.array_equal(small, wan21.backend.decode_video(latents[..., :8]))


def _generate(pipe, **overrides):
    request = GenerationRequest(**{**dict(prompt="a red fox", seed=4, guidance_scale=5.0, n=2, **SHAPE), **overrides})
    jobs = pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    return jobs, pipe.decode(jobs)


def test_layerwise_offload_of_both_experts_equals_the_resident_path_exactly(wan22_a14b_dir):
    plain_jobs, plain = _generate(omni_models.load(str(wan22_a14b_dir)))
    pipe = omni_models.load(str(wan22_a14b_dir), layerwise_offload=True)
    assert set(pipe.offloads) == {"transformer", "transformer_2"} and pipe.offload is pipe.offloads["transformer"]
    jobs, videos = _generate(pipe)
    for job, plain_job in zip(jobs, plain_jobs, strict=True):
        assert torch.equal(job.latents, plain_job.latents)
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(videos, plain, strict=True))
    for model in pipe.backend.denoisers:  # between forwards the streamed blocks hold no weights
        assert all(p.numel() == 0 for block in model.blocks for p in block.parameters())


def test_fp8_of_both_experts_online_and_from_the_cache(wan22_a14b_dir, tmp_path):
    """FP8 is judged on the final latents: the tiny random VAE amplifies any latent change (1% relative noise on the
    latents costs ~19 dB of frame PSNR), so frame PSNR says little about FP8 here. Measured: 0.64% and 0.85%."""
    full_jobs, _ = _generate(omni_models.load(str(wan22_a14b_dir)))
    online = omni_models.load(str(wan22_a14b_dir), quantization="fp8")
    names = online.fp8.quantized
    assert any(n.startswith("blocks.") for n in names) and any(n.startswith("transformer_2.blocks.") for n in names)
    assert not any("condition_embedder" in n or "proj_out" in n for n in names)  # the family's ignore list
    online_jobs, online_videos = _generate(online)
    errors = [
        float((a.latents - b.latents).norm() / b.latents.norm()) for a, b in zip(online_jobs, full_jobs, strict=True)
    ]
    print(f"Wan2.2 A14B FP8 vs fp32, relative L2 of the final latents: {errors}")
    assert max(errors) <= 0.02
    cache = tmp_path / "fp8-cache"
    omni_models.load(str(wan22_a14b_dir), quantization="fp8", fp8_cache_dir=cache)  # a miss: builds both
    assert (cache / "COMPLETE").is_file() and (cache / "transformer_2" / "COMPLETE").is_file()
    warm = omni_models.load(str(wan22_a14b_dir), quantization="fp8", fp8_cache_dir=cache)
    _, warm_videos = _generate(warm)
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(warm_videos, online_videos, strict=True))


def test_compiled_blocks_of_both_experts_keep_the_frames(wan22_a14b_dir):
    _, eager = _generate(omni_models.load(str(wan22_a14b_dir)), n=1)
    pipe = omni_models.load(str(wan22_a14b_dir), compile=True, compile_backend="eager")  # dynamo capture only
    assert pipe.compiled is not None
    compiled_blocks = [
        getattr(block.forward, "_torchdynamo_orig_callable", None)
        for model in pipe.backend.denoisers
        for block in model.blocks
    ]
    assert all(original is not None for original in compiled_blocks)
    _, compiled = _generate(pipe, n=1)
    assert np.array_equal(compiled[0].frames, eager[0].frames)


def test_step_cache_on_wan_blocks_skips_the_middle_per_job_in_a_shared_forward(wan21, wan22_a14b_dir):
    """Wan's blocks carry one stream (the video tokens; the text is cross-attention keys): a cached step adds the
    middle block's residual from the job's last computed step. Jobs with and without a cache share each forward."""
    pipe = wan21
    mask = {"method": "mask", "mask": "medium", "warmup_steps": 2}
    fields = dict(prompt="a red fox", guidance_scale=5.0, height=32, width=48, num_frames=5, num_inference_steps=8)

    def run(caches):
        jobs = [
            job
            for i, cache in enumerate(caches)
            for job in pipe.prepare(resolve_request(pipe.info, GenerationRequest(seed=20 + i, cache=cache, **fields)))
        ]
        pipe.start(jobs)
        bounds = [pipe.step_cache_bytes(job) for job in jobs]
        while not jobs[0].finished:
            pipe.step(jobs)
        held = [0 if job.step_cache is None else job.step_cache.nbytes() for job in jobs]
        assert all(h <= b for h, b in zip(held, bounds, strict=True))
        assert any(held) == any(cache is not None for cache in caches)
        stats = [None if job.step_cache is None else job.step_cache.stats() for job in jobs]
        latents = [job.latents.clone() for job in jobs]
        pipe.release(jobs)
        return latents, stats

    batched, stats = run([mask, None])
    assert stats[0].decisions == "CCCSCSCC" and stats[1] is None
    alone_cached, alone_stats = run([mask])
    alone_plain, _ = run([None, None])
    assert alone_stats[0].decisions == stats[0].decisions
    assert torch.allclose(batched[0], alone_cached[0], atol=1e-5)  # the cached job: as alone
    assert torch.allclose(batched[1], alone_plain[1], atol=1e-5)  # its neighbour: as without any cache
    error = float((batched[0] - alone_plain[0]).norm() / alone_plain[0].norm())
    print(f"step cache (2 of 8 steps cached) vs uncached: relative L2 of the latents {error:.4f}")
    assert 0 < error < 0.2
    two_experts = omni_models.inspect(str(wan22_a14b_dir)).info
    with pytest.raises(InvalidRequestError, match="does not use cache"):
        resolve_request(two_experts, GenerationRequest(prompt="a cat", cache="fast"))


def test_bf16_keeps_diffusers_float32_modules_and_a_float32_vae(wan21_dir):
    """As diffusers loads Wan in bf16 (``_keep_in_fp32_modules``: norms, time embedder, modulation tables) with the
    float32 VAE of Wan's own code and diffusers' examples. Frames are not compared: bf16 noise (1.3% of the latents
    for either pipeline, against fp32) is amplified by the random VAE; the latents are. Measured: 1.5%."""
    pipe = omni_models.load(str(wan21_dir), dtype=torch.bfloat16)
    transformer = pipe.transformer
    assert pipe.backend.pipeline.vae.dtype == torch.float32 and transformer.proj_out.weight.dtype == torch.bfloat16
    kept = [transformer.scale_shift_table, transformer.blocks[0].scale_shift_table]
    kept.append(transformer.condition_embedder.time_embedder.linear_1.weight)
    assert all(p.dtype == torch.float32 for p in kept)
    kwargs = dict(prompt="a red fox", guidance_scale=5.0, **SHAPE)
    jobs = pipe.prepare(resolve_request(pipe.info, GenerationRequest(seed=3, **kwargs)))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    vae = diffusers.AutoencoderKLWan.from_pretrained(str(wan21_dir / "vae"), dtype=torch.float32)
    reference = diffusers.WanPipeline.from_pretrained(str(wan21_dir), vae=vae, dtype=torch.bfloat16)
    expected = reference(generator=torch.Generator("cpu").manual_seed(3), output_type="latent", **kwargs).frames[0]
    error = float((jobs[0].latents - expected).norm() / expected.norm())
    print(f"bf16 latents vs diffusers' bf16 latents: {error:.4f}")
    assert error < 0.03
    assert pipe.decode(jobs)[0].frames.shape == (5, 32, 48, 3)


def test_wan_takes_sequence_parallelism_and_refuses_a_height_its_ranks_cannot_share(wan21_dir):
    """Ulysses SP on Wan gives each rank a band of patch rows (``omni_models.family_parallel``; two gloo ranks
    against one process in test_family_parallel.py); a video whose patch rows the ranks cannot share is refused by
    name before any exchange."""
    from omni_models.family_parallel import UlyssesWanAttnProcessor, enable_family_parallel
    from omni_models.parallel import ParallelState

    pipe = omni_models.load(str(wan21_dir))
    assert omni_models.inspect(str(wan21_dir)).capabilities.sequence_parallel
    enable_family_parallel(pipe, ParallelState(sp_size=2))
    assert all(isinstance(block.attn1.processor, UlyssesWanAttnProcessor) for block in pipe.transformer.blocks)
    assert not any(isinstance(block.attn2.processor, UlyssesWanAttnProcessor) for block in pipe.transformer.blocks)
    with pytest.raises(ValueError, match="sequence-parallel size of 2 does not divide the 1 patch rows of this video"):
        pipe(prompt="a red fox", seed=1, height=16, width=32, num_frames=5, num_inference_steps=1)


def test_the_video_benchmark_runs_every_phase_on_the_cpu(tmp_path) -> None:
    """``benchmarks/video_wan.py --smoke``: every phase the H200 call runs (diffusers, eager, step cache, compiled as
    served, compiled with the cache, FP8 compiled afresh, offload), on tiny configs, before device time goes in."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "video_wan.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "video_wan_smoke.json").read_text())
    assert report["omni"]["psnr_vs_diffusers"] >= TARGET_DB
    assert report["compiled"]["graphs_compiled"] >= 1 and report["compiled"]["psnr_vs_omni"] >= TARGET_DB
    assert report["compiled_cache"]["graphs_compiled"] == 0  # the cache's decisions compile nothing more
    assert report["fp8_compiled"]["graphs_compiled"] >= 1 and report["fp8_compiled"]["fp8_linears"] > 0
    assert report["offload"]["device_weight_bytes"] > 0


def test_a_video_forward_batches_at_most_max_batched_image_tokens(wan21_dir, monkeypatch):
    """``load(max_batched_image_tokens=N)`` on Wan: a row's tokens are its latent frames times the patched grid; two
    guided videos over the budget take one forward each (a video's cond and uncond rows together), and the frames
    equal the same videos in one forward."""
    pipe = omni_models.load(str(wan21_dir), max_batched_image_tokens=1)
    request = resolve_request(
        pipe.info, GenerationRequest(prompt="a red fox", seed=5, n=2, guidance_scale=5.0, **SHAPE)
    )
    jobs = pipe.prepare(request)
    _, frames, height, width = jobs[0].latents.shape
    _, p_h, p_w = pipe.transformer.config.patch_size
    assert pipe.row_tokens(jobs[0]) == frames * (height // p_h) * (width // p_w) > 1
    assert pipe.forward_parts(jobs) == [[jobs[0]], [jobs[1]]]
    pipe.max_batched_image_tokens = 4 * pipe.row_tokens(jobs[0])
    assert pipe.forward_parts(jobs) == [jobs]  # 2 videos x 2 rows fit
    rows = []
    forward = pipe.backend.forward
    monkeypatch.setattr(pipe.backend, "forward", lambda r, *shape: rows.append(len(r)) or forward(r, *shape))
    together = pipe(prompt="a red fox", seed=5, num_videos_per_prompt=2, guidance_scale=5.0, **SHAPE)
    assert rows == [4] * SHAPE["num_inference_steps"]
    rows.clear()
    pipe.max_batched_image_tokens = 3 * pipe.row_tokens(jobs[0])
    apart = pipe(prompt="a red fox", seed=5, num_videos_per_prompt=2, guidance_scale=5.0, **SHAPE)
    assert rows == [2, 2] * SHAPE["num_inference_steps"]
    for a, b in zip(apart, together, strict=True):
        assert video_psnr(a.frames, b.frames) >= TARGET_DB
    with pytest.raises(ValueError, match="max_batched_image_tokens must be >= 0"):
        omni_models.load(str(wan21_dir), max_batched_image_tokens=-1)
