"""Cost of ``--batch-invariant``: one guided ``n=10`` request, batched forwards vs one job per forward (CPU).

Runs the paged engine in-process, so only the forwards differ. Reports the request's wall time in both modes
and how many of its 10 images equal, bit for bit, the same image requested alone (seed + i).

    python benchmarks/batch_invariance.py --out /tmp/invariance
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from omni_models import GenerationRequest, resolve_request
    from omni_server.config import build_config
    from omni_server.engine import build_engine
    from omni_server.protocol import RequestFinished

    prompt = "a red circle at the top left on a blue background"

    def run(engine, request_id: str, n: int, seed: int) -> tuple[list[bytes], float]:
        started = time.monotonic()
        request = GenerationRequest(prompt=prompt, n=n, num_inference_steps=args.steps, guidance_scale=4.0, seed=seed)
        engine.add(request_id, resolve_request(engine.info, request))
        images: list[bytes] = []
        while engine.has_work():
            images += [image for o in engine.step() if isinstance(o, RequestFinished) for image in o.outputs]
        return images, time.monotonic() - started

    results: dict[str, dict] = {}
    for invariant in (False, True):
        engine = build_engine(
            build_config(
                None,
                device=args.device,
                max_num_seqs=4,
                batch_invariant=invariant,
                max_rows_per_step=0,
                kv_cache_memory_bytes="48M",
                warmup=False,
            )
        )
        run(engine, "warm", 10, 0)
        batched, seconds = run(engine, "batched", 10, 100)
        singles = [run(engine, f"single-{i}", 1, 100 + i)[0][0] for i in range(10)]
        engine.close()
        name = "batch_invariant" if invariant else "batched"
        equal = sum(a == b for a, b in zip(batched, singles, strict=True))
        results[name] = {"seconds": seconds, "equal_to_single": equal}
        print(
            f"{name:16s} n=10, {args.steps} steps: {seconds:.2f} s; images equal to single-request: "
            f"{results[name]['equal_to_single']}/10",
            flush=True,
        )
    results["cost"] = results["batch_invariant"]["seconds"] / results["batched"]["seconds"]
    print(f"--batch-invariant costs {results['cost']:.2f}x the batched time")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_invariance.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
