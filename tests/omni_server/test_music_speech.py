"""``POST /v1/audio/speech`` for a music model, served by a real ``omni-server serve`` process on loopback, and
``omni-server generate --lyrics``: the same bytes for the same seed; refused fields get a 400 naming them."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="music models run their AR stage on vLLM: pip install 'omni-server[music]'")
httpx = pytest.importorskip("httpx")

LYRICS = "[verse]\nla la love\n[chorus]\noh oh shine"
CAPTION = "a calm piano melody at 90 bpm in c major"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = (tmp_path_factory.mktemp("music-server") / "server.log").open("w+")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "omni_server", "serve", "omni-tones-tiny", "--device", "cpu", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in 180 s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_speech_returns_wav_and_matches_the_cli(server: str, tmp_path: Path) -> None:
    body = {"input": LYRICS, "instructions": CAPTION, "seed": 7, "max_new_tokens": 48}
    response = httpx.post(f"{server}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(response.content)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (1, 16000, 2)
        assert 0 < w.getnframes() <= 48 * 1000  # a cap: at most 48 frames of 1000 samples
    again = httpx.post(f"{server}/v1/audio/speech", json=body, timeout=120)
    assert again.content == response.content
    other = httpx.post(f"{server}/v1/audio/speech", json={**body, "seed": 8}, timeout=120)
    assert other.content != response.content
    out = tmp_path / "song.wav"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "generate",
            "--model",
            "omni-tones-tiny",
            "--device",
            "cpu",
            "--lyrics",
            LYRICS.replace("\n", "\\n"),
            CAPTION,
            "--image-seed",
            "7",
            "--max-new-tokens",
            "48",
            "-o",
            str(out),
        ],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert out.read_bytes() == response.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"voice": "alloy"}, "voice"),
        ({"ref_audio": "x"}, "ref_audio"),
        ({"language": "en"}, "language"),
        ({"task_type": "tts"}, "task_type"),
        ({"speed": 1.5}, "speed"),
        ({"extra_params": {"cfg_role": "cond"}}, "extra_params.cfg_role"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 100000}, "max_new_tokens"),
        ({"instructions": "  "}, "instructions"),
        ({"input": ""}, "input"),
        ({"seed": -1}, "seed"),
    ],
)
def test_refused_fields_get_a_400_naming_the_field(server: str, extra: dict, param: str) -> None:
    body = {"input": LYRICS, "instructions": CAPTION, **extra}
    response = httpx.post(f"{server}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert param.split(".")[-1] in error["message"]


def test_max_new_tokens_error_states_the_cap(server: str) -> None:
    response = httpx.post(
        f"{server}/v1/audio/speech", json={"input": LYRICS, "instructions": CAPTION, "max_new_tokens": 9001}, timeout=60
    )
    assert response.status_code == 400 and "160" in response.json()["error"]["message"]


def test_playground_has_an_audio_player(server: str) -> None:
    page = httpx.get(server, timeout=30).text
    assert "<audio" in page and "/v1/audio/speech" in page
