"""The music server behind the same front door as the image server (real processes on loopback).

``omni-server serve omni-tones-tiny`` is the same app as the image server: the same guard (API key, Host, body
limit, content type), the same queue bound and request timeout, the same disconnect abort, drain, supervision
and metrics, and the official OpenAI SDK's ``audio.speech.create`` and ``models.retrieve`` work against it.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("vllm", reason="music models run their AR stage on vLLM: pip install 'omni-server[music]'")

MODEL = "omni-tones-tiny"
KEY = "music-key-7"
LYRICS = "[verse]\nla la love\n[chorus]\noh oh shine"
CAPTION = "a calm piano melody at 90 bpm in c major"
SHORT = {"input": LYRICS, "instructions": CAPTION, "seed": 1, "max_new_tokens": 4}
LONG = {"input": LYRICS, "instructions": CAPTION, "seed": 2}  # every frame the model may draw (160)


def _wait(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _health(url: str) -> int:
    """/health's status, -1 while it does not answer within 2 s (a loaded machine, a process starting)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return -1


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return response.json()["error"]


@pytest.fixture(scope="module")
def guarded(server_factory):
    handle = server_factory(MODEL, "--api-key", KEY, "--max-request-body-bytes", "4096")
    yield handle
    handle.stop()


def test_the_music_server_enforces_the_key_host_body_limit_and_content_type(guarded, tools) -> None:
    url = f"{guarded.url}/v1/audio/speech"
    assert _error(httpx.post(url, json=SHORT, timeout=30), 401)["code"] == "invalid_api_key"
    assert _error(httpx.post(url, json=SHORT, headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
    song = httpx.post(url, json=SHORT, headers={"Authorization": f"bearer {KEY}"}, timeout=120)  # any case
    assert song.status_code == 200 and song.headers["content-type"] == "audio/wav", song.text
    assert song.headers.get("x-request-id")
    big = b"x" * (5 * 2**20)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    assert (
        _error(httpx.post(url, content=big, headers={**auth, "Host": "evil.example"}, timeout=30), 400)["code"]
        == "invalid_host"
    )
    assert _error(httpx.post(url, content=big, headers=auth, timeout=30), 413)["code"] == "body_too_large"
    plain = httpx.post(url, content=b'{"input": "la"}', headers={**auth, "Content-Type": "text/plain"}, timeout=30)
    assert _error(plain, 415)["code"] == "unsupported_media_type"
    assert tools.metric(guarded.metrics(), "omni:request_finished_total", outcome="success") >= 1
    assert tools.metric(guarded.metrics(), "omni:engine_ready") == 1


def test_the_openai_sdk_speaks_to_the_music_server(guarded) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.created > 0 and model.object == "model"
    response = client.audio.speech.create(
        model=MODEL,
        voice="default",
        input=LYRICS,
        instructions=CAPTION,
        response_format="wav",
        extra_body={"seed": 3, "max_new_tokens": 4},
    )
    with wave.open(io.BytesIO(response.content)) as song:
        assert (song.getnchannels(), song.getframerate()) == (1, 16000) and song.getnframes() > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model=MODEL, voice="alloy", input=LYRICS, instructions=CAPTION)
    assert refused.value.body["param"] == "voice"


@pytest.fixture(scope="module")
def held(server_factory):
    """One server for the tests that hold the engine (SIGSTOP; a long heartbeat timeout keeps it from counting as
    stalled), kill it and drain it; the last of them stops the server."""
    handle = server_factory(
        MODEL,
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "0",
        # Long enough for a short song on a loaded 2-core CI machine; the held song waits it out (no CPU).
        "--request-timeout",
        "20",
        "--engine-heartbeat-timeout",
        "120",
        "--engine-restarts",
        "1",
        "--shutdown-timeout",
        "1",
    )
    yield handle
    if handle.process.poll() is None:
        handle.stop()


def test_music_requests_are_bounded_by_the_queue_the_timeout_and_the_client(held, tools) -> None:
    """With the engine held a song stays in flight for as long as the test needs: the queue bound, the timeout and
    the disconnect abort apply to it."""
    server = held
    url = f"{server.url}/v1/audio/speech"
    engine = server.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            held_song = pool.submit(httpx.post, url, json=LONG, timeout=60)
            time.sleep(0.5)  # the held song is in flight
            assert _error(httpx.post(url, json=SHORT, timeout=30), 429)["code"] == "queue_full"
            timed_out = held_song.result(timeout=60)
        assert _error(timed_out, 504)["code"] == "request_timeout"
        assert timed_out.headers["x-should-retry"] == "false"

        # A client that goes away while its song waits or runs: the song is aborted.
        aborted_before = tools.metric(server.metrics(), "omni:request_finished_total", outcome="aborted")
        host, port = server.url.removeprefix("http://").split(":")
        body = httpx.Request("POST", url, json={**LONG, "seed": 4}).content
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            time.sleep(0.5)
        _wait(
            lambda: tools.metric(server.metrics(), "omni:request_finished_total", outcome="aborted") > aborted_before,
            5,
            "the disconnected song to be aborted",
        )
    finally:
        os.kill(engine, signal.SIGCONT)
    _wait(lambda: tools.metric(server.metrics(), "omni:num_requests_running") == 0, 30, "the engine to drop both")
    song = httpx.post(url, json=SHORT, timeout=60)
    assert song.status_code == 200 and song.headers["content-type"] == "audio/wav", song.text


def test_a_killed_music_engine_turns_health_503_and_restarts(held) -> None:
    engine = held.engine_pid()
    status, _, seconds = held.kill_and_watch_health(engine)
    assert status == 503 and seconds < 1.0
    _wait(lambda: _health(held.url) == 200, 120, "the engine to restart")
    assert held.engine_pid() != engine
    assert httpx.post(f"{held.url}/v1/audio/speech", json=SHORT, timeout=60).status_code == 200


def test_sigterm_drains_the_music_server_and_exits_0(held, tools) -> None:
    """A song still in flight when the drain ends (the engine held) gets an OpenAI-shape 503; every process exits,
    the server with status 0. (Stops the module's server: the last test here.)"""
    server = held
    engine = server.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    with ThreadPoolExecutor(max_workers=1) as pool:
        held_song = pool.submit(httpx.post, f"{server.url}/v1/audio/speech", json=LONG, timeout=60)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        response = held_song.result(timeout=60)
    assert _error(response, 503)["code"] == "server_shutting_down"
    assert server.process.wait(30) == 0
    _wait(lambda: not tools.pid_alive(engine), 15, "the engine to exit")
