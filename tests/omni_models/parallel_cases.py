"""Shared by test_parallel.py and parallel_worker.py: a random 4-head DiT directory and the jobs both run."""

from __future__ import annotations

from pathlib import Path

import torch

# (prompt, guidance_scale, seed, height, width): a guided and an unguided job in one batch, two image sizes.
CASES = {
    "mixed": [("a red circle", 4.0, 11, 32, 32), ("a blue square at the top left", 1.0, 12, 24, 24)],
    "unguided": [("a green diamond", 1.0, 13, 32, 32)],
}
STEPS = 3


def write_random_model(directory: Path, *, num_heads: int = 4) -> Path:
    """A small causal-prefix DiT with every weight random (no zero-initialised output), saved loadable."""
    from omni_models.checkpoint import load_config, save_model
    from omni_models.config import DiTConfig
    from omni_models.hub import resolve_model_dir
    from omni_models.model import CausalPrefixDiT

    _, vocabulary = load_config(resolve_model_dir("omni-shapes-tiny"))
    config = DiTConfig(
        name="random-dit-4h",
        width=16 * num_heads,
        depth=2,
        num_heads=num_heads,
        patch_size=4,
        vocab_size=len(vocabulary),
        max_prompt_tokens=16,
        supported_sizes=((32, 32), (24, 24)),
        default_steps=STEPS,
    )
    torch.manual_seed(0)
    model = CausalPrefixDiT(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    save_model(model, vocabulary, directory)
    return directory


# A step cache that skips every step its guards allow (the random model's changes are far below the threshold).
CACHE = {"threshold": 5.0, "warmup_steps": 1, "taylor_order": 1}


def run_jobs(pipeline, cases, cache=None, decisions: list | None = None) -> list[torch.Tensor]:
    """All ``cases`` as one batch through the stepwise paged API (a private pool); final latents per job (and each
    job's step-cache decisions appended to ``decisions``)."""
    from omni_models import GenerationRequest, resolve_request

    jobs = [
        job
        for prompt, guidance, seed, h, w in cases
        for job in pipeline.prepare(
            resolve_request(
                pipeline.info,
                GenerationRequest(
                    prompt=prompt,
                    guidance_scale=guidance,
                    seed=seed,
                    height=h,
                    width=w,
                    num_inference_steps=STEPS,
                    cache=cache,
                ),
            )
        )
    ]
    pipeline.allocate_kv_caches_for(jobs, 16)
    pipeline.start(jobs)
    for _ in range(STEPS):
        pipeline.step(jobs)
    if decisions is not None:
        decisions += [None if job.step_cache is None else job.step_cache.stats().decisions for job in jobs]
    return [job.latents.clone() for job in jobs]
