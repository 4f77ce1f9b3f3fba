"""Fault contract: SIGKILL of the engine process while requests are in flight, and start-up failure.

- ``/health`` turns non-200 within 1 s of the kill;
- every in-flight request is answered (503, OpenAI error shape) within 5 s;
- new requests get 503 at once;
- stopping the server afterwards leaves no process behind (checked by ``stop``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest


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
        server.wait_for_running(2, waiting=1)  # all three in the engine before it dies
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


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (this user's, read from /proc)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours
            continue
    return found


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["{tmp}/no-such-model"], "no-such-model"),
        (["--fp8-cache-dir", "{tmp}/fp8"], "needs quantization='fp8'"),
    ],
)
def test_a_failed_check_stops_serve_and_its_prestarted_engine_having_loaded_nothing(tmp_path, tools, args, fragment):
    """``serve`` spawns its engine before ``check_startup`` (the engine imports meanwhile); a check that fails
    exits 2 with its one line, and the engine process is gone with it, having written nothing."""
    marker = f"OMNI_TEST_MARK={uuid.uuid4().hex}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "serve",
            *(a.format(tmp=tmp_path) for a in args),
            "--device",
            "cpu",
            "--port",
            str(tools.free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]},
    )
    assert result.returncode == 2
    assert fragment in result.stderr and "engine" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert _processes_with(marker) == []
    assert list(tmp_path.iterdir()) == []


def test_a_prestarted_engine_imports_then_waits_for_start_loading(tools) -> None:
    """The engine process of ``prestart_engine`` loads nothing until ``StartLoading``: only heartbeats come before
    it, then the engine reports ready; ``Shutdown`` ends it."""
    from omni_server.client import prestart_engine
    from omni_server.config import build_config
    from omni_server.protocol import EngineReady, Heartbeat, Shutdown, StartLoading, decode_output, encode

    config = build_config(None, device="cpu", kv_cache_memory_bytes="32M")
    engine = prestart_engine(config)
    try:
        deadline = time.monotonic() + 8.0  # long enough for the tiny model to load, were it loading
        while time.monotonic() < deadline:
            if engine.conn.poll(0.2):
                assert isinstance(decode_output(engine.conn.recv_bytes()), Heartbeat)
        assert engine.process.is_alive()
        engine.conn.send_bytes(encode(StartLoading()))
        deadline = time.monotonic() + 120.0
        while True:
            assert time.monotonic() < deadline, "no EngineReady"
            if engine.conn.poll(1.0) and isinstance(decode_output(engine.conn.recv_bytes()), EngineReady):
                break
        engine.conn.send_bytes(encode(Shutdown()))
        engine.process.join(30)
        assert engine.process.exitcode == 0
    finally:
        engine.stop(0.0)
