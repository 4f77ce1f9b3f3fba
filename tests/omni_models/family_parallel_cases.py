"""The family jobs test_family_parallel.py runs in one process and on two ranks."""

from __future__ import annotations

import torch

CASES = {
    # a true-CFG job (cond + uncond rows) and an embedded-guidance job, one forward per step
    "flux": [
        dict(
            prompt="a red circle",
            negative_prompt="bad",
            true_cfg_scale=2.0,
            guidance_scale=3.5,
            num_inference_steps=3,
            seed=1,
            height=16,
            width=16,
        ),
        dict(
            prompt="a blue dog",
            negative_prompt=None,
            guidance_scale=4.0,
            num_inference_steps=3,
            seed=2,
            height=16,
            width=16,
        ),
    ],
    "qwen": [
        dict(
            prompt="a blue dog at night",
            negative_prompt="bad",
            true_cfg_scale=3.0,
            num_inference_steps=3,
            seed=2,
            height=16,
            width=16,
        ),
        dict(prompt="a cat", negative_prompt=None, num_inference_steps=3, seed=3, height=16, width=16),
    ],
    # Wan2.2 A14B: a CFG job and an unguided one (guidance 1: one row), across both experts; 32 pixels high: 2 patch
    # rows, one per SP rank
    "wan": [
        dict(
            prompt="a red fox",
            negative_prompt="blurry",
            guidance_scale=5.0,
            num_inference_steps=4,
            seed=1,
            height=32,
            width=32,
            num_frames=5,
        ),
        dict(
            prompt="a blue square", guidance_scale=1.0, num_inference_steps=4, seed=2, height=32, width=32, num_frames=5
        ),
    ],
}


# A step cache that skips every step its guards allow (the random models' changes are far below the threshold).
CACHE = {"threshold": 5.0, "warmup_steps": 1, "taylor_order": 1}


def run_family_jobs(pipe, family: str, cache=None) -> list[torch.Tensor]:
    return run_family_jobs_with_decisions(pipe, family, cache)[0]


def run_family_jobs_with_decisions(pipe, family: str, cache=None) -> tuple[list[torch.Tensor], list]:
    """Final latents per job and each job's step-cache decisions (None without a cache)."""
    from omni_models import GenerationRequest, resolve_request

    jobs = [
        job
        for request in CASES[family]
        for job in pipe.prepare(resolve_request(pipe.info, GenerationRequest(**request, cache=cache)))
    ]
    pipe.start(jobs)
    while not all(job.finished for job in jobs):
        pipe.step(jobs)
    decisions = [None if job.step_cache is None else job.step_cache.stats().decisions for job in jobs]
    return [job.latents.float().clone() for job in jobs], decisions
