"""A 20-step request while other processes keep every CPU busy: the engine's thread budget vs fixed settings.

Starts ``omni-server serve`` (CPU) once per setting, keeps one busy-looping process per CPU of this process's
affinity mask running beside it, and times ``--requests`` sequential 20-step requests (median, max):

- ``budget``: the engine's own choice (``omni_server.cpu_budget``: affinity and cgroup quota, passive waits);
- ``omp1``: ``OMP_NUM_THREADS=1``, the baseline the issue measured (0.58 s median contended);
- ``spinning``: one thread per CPU with ``OMP_WAIT_POLICY=ACTIVE``, the old default's worst case.

Also times the uncontended request for each, so the cost of the busy neighbours is visible.

    python benchmarks/contended_threads.py --out /tmp/threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fair_scheduling import post  # noqa: E402
from server_overhead import free_port, wait_healthy  # noqa: E402

BODY = {"prompt": "a red circle at the top left on a blue background", "num_inference_steps": 20, "seed": 1}


def settings(cpus: int) -> dict[str, dict[str, str]]:
    return {
        "budget": {},
        "omp1": {"OMP_NUM_THREADS": "1"},
        "spinning": {"OMP_NUM_THREADS": str(cpus), "OMP_WAIT_POLICY": "ACTIVE"},
    }


def time_requests(port: int, count: int) -> list[float]:
    times = []
    for _ in range(count):
        status, latency = post(port, BODY)
        assert status == 200, status
        times.append(latency)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    base_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
    }
    results: dict[str, dict] = {"cpus_in_affinity": cpus}
    for name, extra in settings(cpus).items():
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omni_server",
                "serve",
                "--device",
                "cpu",
                "--port",
                str(port),
                "--kv-cache-memory-bytes",
                "16M",
            ],
            env={**base_env, **extra},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        hogs: list[subprocess.Popen] = []
        try:
            wait_healthy(port, server, 300)
            post(port, BODY)  # warm
            idle = time_requests(port, max(2, args.requests // 2))
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
            time.sleep(1.0)
            contended = time_requests(port, args.requests)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
            server.terminate()
            server.wait(60)
        results[name] = {
            "env": extra,
            "idle_s": idle,
            "contended_s": contended,
            "idle_median_s": statistics.median(idle),
            "contended_median_s": statistics.median(contended),
            "contended_max_s": max(contended),
        }
        print(
            f"{name:9s} idle median {results[name]['idle_median_s']:.2f} s; beside {cpus} busy processes median "
            f"{results[name]['contended_median_s']:.2f} s, max {results[name]['contended_max_s']:.2f} s",
            flush=True,
        )
    ratio = results["budget"]["contended_median_s"] / results["omp1"]["contended_median_s"]
    results["budget_over_omp1_contended"] = ratio
    print(f"contended median, engine budget / OMP_NUM_THREADS=1: {ratio:.2f}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "contended_threads.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
