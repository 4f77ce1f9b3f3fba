"""The step cache with FP8 and with layerwise offload (CPU): same decisions, same images, fewer block transfers.

    python benchmarks/step_cache_composition.py [MODEL] [--cache fast] [--steps 28] [--scenes 4]

For a FLUX.1 checkpoint (default: the shipped omni-flux-shapes-tiny) and the first held-out shapes scenes, in one
run: each configuration (plain, ``--quantization fp8``, layerwise offload) uncached and with the cache; reports
the cached images' PSNR against the same configuration's uncached ones, whether the decisions equal the plain
run's, and for offload the block weight transfers per image (``LayerwiseOffload``'s slot fills, counted by
wrapping its ``_fill``), uncached vs cached. The blocks a step skips on every row are never called, so their
weights are not streamed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

import omni_models  # noqa: E402
from omni_models import GenerationRequest, resolve_request  # noqa: E402
from omni_models.training.shapes import split_scenes  # noqa: E402

SHIPPED = Path(omni_models.__file__).parent / "weights" / "omni-flux-shapes-tiny"


def psnr(a, b) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def generate(pipe, prompts, steps: int, cache):
    jobs = []
    for index, prompt in enumerate(prompts):
        request = GenerationRequest(
            prompt=prompt, negative_prompt=None, num_inference_steps=steps, seed=10_000 + index, cache=cache
        )
        jobs += pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    images = pipe.decode(jobs)
    decisions = [job.step_cache.stats().decisions if job.step_cache else None for job in jobs]
    pipe.release(jobs)
    return images, decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(SHIPPED))
    parser.add_argument("--cache", default="fast")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--scenes", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [scene.caption() for scene in split_scenes()[1][: args.scenes]]
    record = {}
    plain_decisions = None
    for label, options in (("plain", {}), ("fp8", {"quantization": "fp8"}), ("offload", {"layerwise_offload": True})):
        pipe = omni_models.load(args.model, device="cpu", **options)
        fills = []
        if pipe.offload is not None:
            original = pipe.offload._fill

            def counted(k, index, original=original):
                fills.append(k)
                return original(k, index)

            pipe.offload._fill = counted
        uncached, _ = generate(pipe, prompts, args.steps, None)
        uncached_fills = len(fills)
        fills.clear()
        cached, decisions = generate(pipe, prompts, args.steps, args.cache)
        plain_decisions = plain_decisions or decisions
        record[label] = {
            "psnr_cached_vs_uncached_db": [psnr(a, b) for a, b in zip(uncached, cached, strict=True)],
            "decisions": decisions,
            "decisions_equal_plain": decisions == plain_decisions,
            "block_fills_uncached": uncached_fills if pipe.offload is not None else None,
            "block_fills_cached": len(fills) if pipe.offload is not None else None,
        }
        print(label, json.dumps(record[label]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
