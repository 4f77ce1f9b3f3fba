"""Recompiles from step-cache decision patterns under regional compilation (CPU, ``torch.compile`` backend eager).

    python benchmarks/step_cache_compile.py [MODEL]

Loads a FLUX.1 checkpoint (default: the shipped omni-flux-shapes-tiny), compiles each transformer block
(``FamilyPipeline.compile_transformer``), then counts dynamo's unique graphs after: one uncached request (1 row),
four uncached requests in one forward (4 rows: the batch-size recompile any server sees), and two rounds of four
requests with different step caches in the same forwards, whose computing rows change from block to block and step
to step. A decision pattern that recompiled would add graphs in the last two lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from torch._dynamo.utils import counters  # noqa: E402

import omni_models  # noqa: E402
from omni_models import GenerationRequest, resolve_request  # noqa: E402

SHIPPED = Path(omni_models.__file__).parent / "weights" / "omni-flux-shapes-tiny"


def run(pipe, caches, steps: int = 8) -> list[str | None]:
    jobs = []
    for index, cache in enumerate(caches):
        request = GenerationRequest(prompt="a red circle", seed=index, num_inference_steps=steps, cache=cache)
        jobs += pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    decisions = [job.step_cache.stats().decisions if job.step_cache else None for job in jobs]
    pipe.release(jobs)
    return decisions


def main() -> None:
    pipe = omni_models.load(sys.argv[1] if len(sys.argv) > 1 else str(SHIPPED), device="cpu")
    pipe.compile_transformer(backend="eager")
    rounds = [
        ("uncached, 1 row", ["off"]),
        ("uncached, 4 rows", ["off"] * 4),
        ("4 caches, round 1", ["off", "safe", "fast", {"threshold": 0.3, "warmup_steps": 1}]),
        ("4 caches, round 2", ["fast", {"threshold": 0.2}, "off", {"threshold": 0.5}]),
    ]
    for label, caches in rounds:
        decisions = run(pipe, caches)
        print(f"{label:20s} unique graphs {counters['stats']['unique_graphs']:3d}  decisions {decisions}", flush=True)


if __name__ == "__main__":
    main()
