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
}


def run_family_jobs(pipe, family: str) -> list[torch.Tensor]:
    from omni_models import GenerationRequest, resolve_request

    jobs = [
        job
        for request in CASES[family]
        for job in pipe.prepare(resolve_request(pipe.info, GenerationRequest(**request)))
    ]
    pipe.start(jobs)
    while not all(job.finished for job in jobs):
        pipe.step(jobs)
    return [job.latents.float().clone() for job in jobs]
