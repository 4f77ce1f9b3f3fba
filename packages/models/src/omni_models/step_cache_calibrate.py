"""Calibrate MagCache-style step caching for one model and steps count: the middle residual's magnitude ratios.

    python -m omni_models.step_cache_calibrate MODEL --steps N [--prompt TEXT ...] [--first-blocks F]
        [--last-blocks B] [--threshold T] [--seed S] [--device cpu|cuda] [--out FILE]

Runs the prompts uncached (every step computes the middle blocks through ``step_cache_blocks``, so the residual
recorded is exactly the one a cached step reuses), reads each step's mean absolute middle residual per image, and
averages over the prompts the ratio of each step's magnitude to the previous step's (step 0: 1). It prints, and
writes to ``--out``, the cache object to serve with: ``{"method": "magcache", "first_blocks": F, "last_blocks": B,
"threshold": T, "ratios": [...]}`` -- a request's ``cache`` field, or ``omni-server --step-cache-config``. The
ratios belong to that model and steps count (a request of another count is refused naming ``cache.ratios``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = (
    "a red circle at the top left on a white background",
    "a blue square on a black background",
    "a green triangle at the bottom right on a white background",
    "a yellow diamond at the center on a purple background",
)


def magnitudes(pipe: Any, prompt: str, *, steps: int, seed: int, first_blocks: int, last_blocks: int) -> list[float]:
    """Each step's mean absolute middle residual (over the image's rows) for one prompt."""
    import torch

    from omni_models import GenerationRequest, resolve_request

    cache = {"method": "mask", "mask": list(range(steps)), "first_blocks": first_blocks, "last_blocks": last_blocks}
    request = GenerationRequest(prompt=prompt, negative_prompt=None, num_inference_steps=steps, seed=seed, cache=cache)
    jobs = pipe.prepare(resolve_request(pipe.info, request))
    if pipe.info.paged_kv:
        pipe.allocate_kv_caches_for(jobs, 16)
    pipe.start(jobs)
    out = []
    with torch.no_grad():
        while not jobs[0].finished:
            pipe.step(jobs)
            rows = jobs[0].step_cache.rows
            out.append(statistics.fmean(float(row.factors[0][0].abs().float().mean()) for row in rows))
    pipe.release(jobs)
    return out


def calibrate(
    pipe: Any,
    prompts: list[str],
    *,
    steps: int,
    seed: int = 0,
    first_blocks: int = 1,
    last_blocks: int = 0,
    threshold: float = 0.1,
) -> dict[str, Any]:
    """The magcache config for ``pipe`` at ``steps`` steps (see the module docstring)."""
    per_prompt = []
    for index, prompt in enumerate(prompts):
        values = magnitudes(
            pipe, prompt, steps=steps, seed=seed + index, first_blocks=first_blocks, last_blocks=last_blocks
        )
        per_prompt.append([1.0] + [b / a if a > 0 else 1.0 for a, b in zip(values[:-1], values[1:], strict=True)])
    ratios = [statistics.fmean(column) for column in zip(*per_prompt, strict=True)]
    return {
        "method": "magcache",
        "first_blocks": first_blocks,
        "last_blocks": last_blocks,
        "threshold": threshold,
        "ratios": [round(r, 6) for r in ratios],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="shipped name, local directory or cached repo id (what omni_models.load takes)")
    parser.add_argument("--steps", type=int, required=True, help="the steps count the ratios are for")
    parser.add_argument("--prompt", action="append", default=None, help="repeatable (default: four shapes prompts)")
    parser.add_argument("--first-blocks", type=int, default=1)
    parser.add_argument("--last-blocks", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.1, help="the accumulated-error bound written out")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the cache object here (JSON)")
    args = parser.parse_args(argv)
    import omni_models

    pipe = omni_models.load(args.model, device=args.device)
    config = calibrate(
        pipe,
        list(args.prompt or DEFAULT_PROMPTS),
        steps=args.steps,
        seed=args.seed,
        first_blocks=args.first_blocks,
        last_blocks=args.last_blocks,
        threshold=args.threshold,
    )
    text = json.dumps(config)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return config


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
