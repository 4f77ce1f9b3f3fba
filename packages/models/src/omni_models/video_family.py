"""Video families from diffusers checkpoints (Wan 2.1 / 2.2: ``omni_models.backends.wan``): the stepwise pipeline.

``VideoFamilyPipeline`` is a ``FamilyPipeline`` (the same ``prepare / start / step / decode / release`` contract,
prompt conditioning, prompt-embedding cache and release) whose jobs are videos:

- ``prepare(resolved)`` returns ``n`` ``VideoJob``s (video ``i`` seeded ``seed + i``) sharing one
  ``PromptConditioning``; each draws its initial latents ``[C, T', H', W']`` (float32, diffusers' recipe for
  ``generator=torch.Generator("cpu").manual_seed(seed)``) and gets its own copy of the checkpoint's scheduler (Wan
  ships UniPC, a multistep solver with per-video history, so each job carries its own state);
- ``step(jobs)``: the rows (cond, plus uncond under CFG) of every job with the same ``batch_key`` -- frames, size,
  and which expert denoises its current step -- go through ONE transformer forward; a two-expert model (Wan2.2
  A14B) runs ``transformer`` while the step's timestep is at or above ``boundary_ratio * num_train_timesteps``,
  then ``transformer_2`` with ``guidance_scale_2``, as diffusers' ``WanPipeline`` does;
- ``decode(jobs)`` returns one ``omni_models.Video`` per job (8-bit frames ``(T, H, W, 3)`` and the request's
  ``fps``), decoding one video at a time through the backend's VAE (bounded: see ``backends.wan``).

CFG follows ``WanPipeline``: it runs when ``guidance_scale > 1``, against the negative prompt or ``""`` when the
request has none. The per-step progress of a job is its ``step_index`` of ``num_steps``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import Tensor

from omni_models.families import DenoiseRow, FamilyJob, FamilyPipeline, PromptConditioning
from omni_models.request import ResolvedRequest, prepare_one_call
from omni_models.video import Video


@dataclass(eq=False)
class VideoJob(FamilyJob):
    """One video's state. Invariant: ``latents`` (float32 ``[C, T', H', W']``) and ``scheduler`` are the sampler
    state after ``step_index`` steps; ``experts[i]`` is the denoiser of step ``i`` (0: ``transformer``, 1:
    ``transformer_2``) and ``scales[e]`` the CFG scale expert ``e`` uses."""

    scheduler: Any = None
    experts: tuple[int, ...] = ()
    scales: tuple[float, ...] = ()

    @property
    def expert(self) -> int:
        return self.experts[self.step_index]

    @property
    def num_frames(self) -> int:
        return self.request.num_frames

    @property
    def batch_key(self) -> tuple[int, int, int, int]:  # type: ignore[override]
        """Jobs with equal keys share one transformer forward: the same latent shape and the same expert."""
        return self.request.num_frames, self.request.height, self.request.width, self.expert


class VideoFamilyPipeline(FamilyPipeline):
    """A loaded video checkpoint; its backend is a ``WanBackend``. Not thread-safe: one caller drives it."""

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[VideoJob]:
        """The request's ``n`` jobs sharing one ``PromptConditioning``; nothing runs on the model."""
        guided = request.guidance_scale > 1.0
        scale_2 = request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2
        conditioning = PromptConditioning(request.prompt, (request.negative_prompt or "") if guided else None)
        jobs = []
        for index in range(request.n):
            video = msgspec.structs.replace(request, n=1, seed=request.seed + index)
            scheduler = self.backend.job_scheduler(request.num_inference_steps)
            timesteps = scheduler.timesteps.cpu()
            job = VideoJob(
                request=video,
                guidance=None,
                true_cfg_scale=request.guidance_scale,
                conditioning=conditioning,
                latents=self.backend.initial_latents(video.seed, video.num_frames, video.height, video.width),
                sigmas=scheduler.sigmas.cpu(),
                timesteps=timesteps,
                request_id=request_id,
                scheduler=scheduler,
                experts=self.backend.experts(timesteps),
                scales=(request.guidance_scale, scale_2),
            )
            job.step_cache = self._job_step_cache(job)
            jobs.append(job)
        return jobs

    def step_cache_bytes(self, job: FamilyJob) -> int:
        """The most memory ``job``'s step cache holds: per row, the video tokens' one stream (Wan's blocks carry no
        text stream)."""
        if job.step_cache is None:
            return 0
        from omni_models.step_cache_blocks import JobStepCache

        config = self.transformer.config
        width = config.num_attention_heads * config.attention_head_dim
        streams = [(self.row_tokens(job) * width,)] * job.num_rows
        return JobStepCache.bytes_bound(job.step_cache.config, streams, torch.finfo(self.dtype).bits // 8)

    @torch.no_grad()
    def step(self, jobs: Sequence[VideoJob]) -> None:  # type: ignore[override]
        """One step for every job: one transformer forward per distinct ``batch_key``."""
        self._check_batch(jobs)
        by_key: dict[tuple[int, int, int, int], list[VideoJob]] = defaultdict(list)
        for job in jobs:
            by_key[job.batch_key].append(job)
        for (_, _, _, expert), group in by_key.items():
            for part in self.forward_parts(group):
                self._step_video_group(part, expert)

    def row_tokens(self, job: FamilyJob) -> int:
        """The video tokens of one of ``job``'s rows: latent frames times the patched latent grid."""
        _, frames, height, width = job.latents.shape
        _, p_h, p_w = self.transformer.config.patch_size
        return frames * (height // p_h) * (width // p_w)

    def _step_video_group(self, group: Sequence[VideoJob], expert: int) -> None:
        rows, caches = [], []
        for job in group:
            timestep = job.scheduler.timesteps[job.step_index]
            rows.append(DenoiseRow(job.latents, job.conditioning.cond, timestep, None))
            caches.append((job.step_cache, 0, job.step_index))
            if job.guided:
                rows.append(DenoiseRow(job.latents, job.conditioning.uncond, timestep, None))
                caches.append((job.step_cache, 1, job.step_index))
        velocities = iter(self._forward(rows, caches, expert))
        for job in group:
            prediction = next(velocities)
            if job.guided:
                prediction = self.backend.guide(prediction, next(velocities), job.scales[expert])
            timestep = job.scheduler.timesteps[job.step_index]
            latents = job.scheduler.step(prediction[None], timestep, job.latents[None], return_dict=False)[0]
            job.latents = latents[0]
            job.step_index += 1

    @torch.no_grad()
    def decode(self, jobs: Sequence[VideoJob]) -> list[Video]:  # type: ignore[override]
        """The videos of finished jobs, in order, one VAE decode at a time (memory bounded by one video)."""
        for job in jobs:
            if not job.finished:
                raise ValueError(f"job is at step {job.step_index} of {job.num_steps}; decode needs a finished job")
        return [Video.from_float(self.backend.decode_video(job.latents), job.request.fps) for job in jobs]

    def release(self, jobs: Sequence[VideoJob]) -> None:  # type: ignore[override]
        """Drop the jobs' text embeddings and their schedulers' history."""
        super().release(jobs)
        for job in jobs:
            job.scheduler = None

    def __call__(  # type: ignore[override]
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str | None] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        num_videos_per_prompt: int = 1,
        callback_on_step_end: Callable[[VideoFamilyPipeline, int, Tensor, dict[str, Any]], Any] | None = None,
    ) -> list[Video]:
        """Videos for each prompt, ``num_videos_per_prompt`` each, seeds consecutive from ``seed`` (diffusers'
        ``WanPipeline`` arguments; ``negative_prompt=None`` is ``""`` under CFG, as there).
        ``callback_on_step_end(pipeline, step_index, timestep, {"latents": [B, C, T', H', W']})`` observes every
        step."""
        jobs = prepare_one_call(
            self,
            prompt,
            negative_prompt,
            seed,
            n=num_videos_per_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            fps=fps,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
        )
        return self._run_one_call(jobs, callback_on_step_end)


__all__ = ["VideoFamilyPipeline", "VideoJob"]
