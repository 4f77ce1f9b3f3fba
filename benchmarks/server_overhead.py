"""Server overhead: end-to-end HTTP latency of ``omni-server`` vs a direct pipeline call, same requests, one run.

The server runs as a real ``omni-server serve`` subprocess (API process + engine process) on loopback; the
direct baseline loads the same model in this process and calls ``pipeline(...)``. Requests alternate
(direct, HTTP, direct, HTTP, ...) with identical prompt, seed, size and steps, one at a time, after warm-up, so
both see the same machine state. Overhead = p50(HTTP) - p50(direct); target <= 30 ms.

    python benchmarks/server_overhead.py --out OUT_DIR              # GPU (cuda), the defaults below
    python benchmarks/server_overhead.py --smoke --out /tmp/smoke   # tiny CPU run

Only the standard library talks HTTP here (http.client), so the client adds no dependency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def wait_healthy(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} during start-up")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy within {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for server_overhead.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--model", default="omni-shapes-tiny")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=None, help="measured requests per path (default 50; 8 smoke)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 20; 2 smoke)")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.smoke else "cuda")
    requests = args.requests or (8 if args.smoke else 50)
    steps = args.steps or (2 if args.smoke else 20)
    warmup = min(args.warmup, 2) if args.smoke else args.warmup

    import torch

    import omni_models
    from omni_server.config import build_config
    from omni_server.engine import load_pipeline

    dtype = args.dtype
    config = build_config(None, model=args.model, device=device, dtype=dtype)
    pipeline = load_pipeline(config)
    height, width = pipeline.info.image.default_size
    body = {
        "prompt": "a red circle on a blue background",
        "num_inference_steps": steps,
        "seed": 1234,
        "size": f"{width}x{height}",
        "response_format": "b64_json",
    }
    payload = json.dumps(body).encode()

    def direct() -> float:
        start = time.perf_counter()
        pipeline(body["prompt"], num_inference_steps=steps, seed=body["seed"], height=height, width=width)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def start_server(kv_sizing: list[str]) -> tuple[subprocess.Popen, int]:
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omni_server",
                "serve",
                args.model,
                "--device",
                device,
                "--dtype",
                dtype,
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--max-num-seqs",
                "1",
                *kv_sizing,
            ],
            env=os.environ.copy(),
        )
        try:
            wait_healthy(port, server, timeout=600)
        except RuntimeError:
            server.kill()
            server.wait(30)
            raise
        return server, port

    # On CUDA the engine profiles and sizes its own pool (half the card: this process holds a model too). If
    # that start fails, the error is recorded and the run continues with an explicit pool, so one GPU call
    # both checks the profiled start-up and measures the overhead.
    kv_sizing = ["--kv-cache-memory-bytes", "64M"] if device == "cpu" else ["--gpu-memory-utilization", "0.5"]
    profiled_start_error = None
    try:
        server, port = start_server(kv_sizing)
    except RuntimeError as exc:
        profiled_start_error = str(exc)
        print(f"profiled start-up FAILED ({exc}); measuring with --kv-cache-memory-bytes 1G", file=sys.stderr)
        kv_sizing = ["--kv-cache-memory-bytes", "1G"]
        server, port = start_server(kv_sizing)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def over_http() -> float:
            start = time.perf_counter()
            conn.request("POST", "/v1/images/generations", body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            elapsed = time.perf_counter() - start
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {data[:500]!r}")
            return elapsed

        conn.request("GET", "/metrics")
        metrics_text = conn.getresponse().read().decode()
        kv_blocks_total = next(
            float(line.rsplit(" ", 1)[1])
            for line in metrics_text.splitlines()
            if line.startswith("omni:kv_cache_blocks_total")
        )
        for _ in range(warmup):
            direct()
            over_http()
        direct_s, http_s = [], []
        for _ in range(requests):
            direct_s.append(direct())
            http_s.append(over_http())
    finally:
        server.terminate()
        server.wait(30)

    figures = {
        "model": args.model,
        "device": device,
        "dtype": dtype,
        "size": f"{width}x{height}",
        "steps": steps,
        "requests": requests,
        "kv_sizing": " ".join(kv_sizing),
        "kv_blocks_total": kv_blocks_total,
        "profiled_start_error": profiled_start_error,
        "direct_p50_ms": 1e3 * statistics.median(direct_s),
        "direct_p99_ms": 1e3 * percentile(direct_s, 99),
        "http_p50_ms": 1e3 * statistics.median(http_s),
        "http_p99_ms": 1e3 * percentile(http_s, 99),
    }
    figures["overhead_p50_ms"] = figures["http_p50_ms"] - figures["direct_p50_ms"]
    figures["overhead_p99_ms"] = figures["http_p99_ms"] - figures["direct_p99_ms"]
    figures["http_over_direct_p50"] = figures["http_p50_ms"] / figures["direct_p50_ms"]
    figures["target_overhead_p50_ms"] = 30.0
    figures["meets_target"] = figures["overhead_p50_ms"] <= 30.0
    figures["torch"] = torch.__version__
    figures["omni_models"] = omni_models.__version__
    if device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name()

    print(f"server overhead: {args.model} {width}x{height}, {steps} steps, {requests} requests, {device}")
    print(f"{'path':<8}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct':<8}{figures['direct_p50_ms']:>10.2f}{figures['direct_p99_ms']:>10.2f}")
    print(f"{'http':<8}{figures['http_p50_ms']:>10.2f}{figures['http_p99_ms']:>10.2f}")
    print(
        f"overhead p50 {figures['overhead_p50_ms']:.2f} ms (target <= 30), p99 {figures['overhead_p99_ms']:.2f} ms; "
        f"http/direct p50 = {figures['http_over_direct_p50']:.3f}x"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "server_overhead.json").write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
