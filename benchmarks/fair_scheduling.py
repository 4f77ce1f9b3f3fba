"""Fair scheduling: latency of a short request while long multi-image requests hold most of the KV pool.

Scenario (issue 17): the pool holds about 1.6 guided ``n=10`` requests. One ``n=10`` long request runs, a
second one waits for blocks, and a 2-step ``n=1`` request arrives. FIFO admission keeps the short request behind the
waiting ``n=10`` one until the first long request finishes; fair admission (``omni_server.scheduling_policy``) runs it
at once, in small forwards (``--max-rows-per-step``). Target: contended latency <= 3 x standalone latency + one batch
step (the mean forward latency measured while the long requests run, from ``/metrics``; with a row budget a forward
carries at most ``--max-rows-per-step`` rows, so the full-batch step is also reported). The server is stopped once the
short requests are measured (the long ones need minutes on a CPU).

    python benchmarks/fair_scheduling.py --out /tmp/fair          # CPU, a few minutes on 2 shared cores

The server is a real ``omni-server serve`` subprocess on loopback; only the standard library talks HTTP.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_overhead import free_port, wait_healthy  # noqa: E402

BLOCK_SIZE = 16
SHORT = {"prompt": "a red circle on a blue background", "n": 1, "num_inference_steps": 2, "guidance_scale": 4.0}


def post(port: int, body: dict, timeout: float = 600.0) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/images/generations", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status, time.monotonic() - started


def metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def pool_bytes(rows: float) -> int:
    import omni_models
    from diffusion_kv.sizing import kv_cache_bytes_per_block

    pipeline = omni_models.load("omni-shapes-tiny", device="cpu")
    [job] = pipeline.prepare(omni_models.resolve_request(pipeline.info, omni_models.GenerationRequest(prompt="a")))
    row_tokens = job.rows[0].target_len + pipeline.info.image.max_prompt_tokens
    blocks = int(rows * -(-row_tokens // BLOCK_SIZE)) + 1
    return blocks * kv_cache_bytes_per_block(pipeline.kv_cache_specs(), BLOCK_SIZE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--long-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-rows-per-step", type=int, default=None, help="passed to the server (default: its own)")
    args = parser.parse_args()

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "omni_server",
        "serve",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--max-num-seqs",
        "4",
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-cache-memory-bytes",
        str(pool_bytes(32)),
    ]
    if args.max_rows_per_step is not None:
        argv += ["--max-rows-per-step", str(args.max_rows_per_step)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, server, 300)
        standalone = [post(port, SHORT)[1] for _ in range(args.repeats + 1)][1:]
        long_body = {"prompt": "a green square", "n": 10, "num_inference_steps": args.long_steps, "guidance_scale": 4.0}
        long_results: list[tuple[int, float]] = []

        def run_long() -> None:
            try:
                long_results.append(post(port, long_body))
            except OSError:  # the server is stopped once the short requests are measured
                pass

        threads = [threading.Thread(target=run_long, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while metric(port, "omni:num_requests_waiting") < 1 or metric(port, "omni:num_requests_running") < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the long requests never reached one running + one waiting")
            time.sleep(0.1)
        steps_before = (
            metric(port, "omni:denoise_step_latency_seconds_sum"),
            metric(port, "omni:denoise_step_latency_seconds_count"),
        )
        contended = []
        for _ in range(args.repeats):
            status, latency = post(port, SHORT)
            assert status == 200, status
            contended.append(latency)
            waiting = metric(port, "omni:num_requests_waiting")
        steps_after = (
            metric(port, "omni:denoise_step_latency_seconds_sum"),
            metric(port, "omni:denoise_step_latency_seconds_count"),
        )
        batch_step = (steps_after[0] - steps_before[0]) / max(steps_after[1] - steps_before[1], 1)
        long_still_waiting = waiting >= 1
    finally:
        server.terminate()
        server.wait(60)

    standalone_p50 = statistics.median(standalone)
    contended_p50 = statistics.median(contended)
    bound = 3 * standalone_p50 + batch_step
    result = {
        "standalone_s": standalone,
        "contended_s": contended,
        "standalone_p50_s": standalone_p50,
        "contended_p50_s": contended_p50,
        "mean_batch_step_s": batch_step,
        "bound_s": bound,
        "ratio_to_bound": contended_p50 / bound,
        "max_rows_per_step": args.max_rows_per_step,
        "contended_over_standalone": contended_p50 / standalone_p50,
        "second_long_request_still_waiting": long_still_waiting,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    print(
        f"short request p50: standalone {standalone_p50 * 1000:.0f} ms, beside 2 x n=10 long requests "
        f"{contended_p50 * 1000:.0f} ms; bound 3 x standalone + one batch step ({batch_step * 1000:.0f} ms) = "
        f"{bound * 1000:.0f} ms -> {'MET' if contended_p50 <= bound else 'NOT MET'} ({contended_p50 / bound:.2f}x)"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fair_scheduling.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
