"""Fault contract: SIGKILL of the engine process while requests are in flight, and start-up failure.

- ``/health`` turns non-200 within 1 s of the kill;
- every in-flight request is answered (503, OpenAI error shape) within 5 s;
- new requests get 503 at once;
- stopping the server afterwards leaves no process behind (checked by ``stop``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def test_sigkill_of_the_engine_fails_fast_and_leaves_no_orphans(server_factory, tools) -> None:
    # One restart allowed: the checks below run while it restarts (a death past --engine-restarts ends the
    # server, see test_front_door).
    server = server_factory("--max-num-seqs", "2", "--kv-cache-memory-bytes", "32M", "--engine-restarts", "1")
    engine = server.engine_pid()

    def long_request(i: int) -> tuple[int, dict, float]:
        response = httpx.post(
            f"{server.url}/v1/images/generations",
            json={
                "prompt": ("a red circle", "a blue square", "a green diamond")[i],
                "num_inference_steps": 1000,
                "guidance_scale": 1.0,
            },
            timeout=60,
        )
        return response.status_code, response.json(), time.monotonic()

    with ThreadPoolExecutor(max_workers=3) as pool:
        in_flight = [pool.submit(long_request, i) for i in range(3)]  # 2 running + 1 waiting
        server.wait_for_running(2)
        health_status, killed, health_latency = server.kill_and_watch_health(engine)
        assert health_status == 503, "/health still 200 one second after the engine was killed"
        assert health_latency < 1.0

        for future in in_flight:
            status, body, answered = future.result(timeout=10)
            assert status == 503
            assert body["error"]["code"] == "engine_dead"
            assert "exited unexpectedly" in body["error"]["message"]
            assert answered - killed < 5.0

    response = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x"}, timeout=5)
    assert response.status_code == 503
    text = server.metrics()
    assert tools.metric(text, "omni:engine_ready") == 0.0
    # The dead engine's requests and blocks are gone: /metrics says so instead of showing its last stats.
    assert tools.metric(text, "omni:num_requests_running") == 0.0
    assert tools.metric(text, "omni:kv_cache_blocks_in_use") == 0.0
    assert not tools.pid_alive(engine)
    server.stop()


def test_engine_start_up_failure_exits_nonzero_with_the_reason(tmp_path, tools) -> None:
    # A KV budget of one byte passes the checkpoint check but cannot hold a single block: the engine fails.
    port = tools.free_port()
    result = subprocess.run(
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
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "engine failed to start" in result.stderr
    assert "cannot size the KV pool" in result.stderr


def test_an_unknown_model_stops_serve_before_the_engine_starts(tmp_path, tools) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "serve",
            str(tmp_path / "no-such-model"),
            "--device",
            "cpu",
            "--port",
            str(tools.free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no-such-model" in result.stderr and "engine" not in result.stderr
