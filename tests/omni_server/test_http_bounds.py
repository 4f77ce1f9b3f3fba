"""Hostile clients, end to end on loopback: every bound answered in the OpenAI error shape, nothing hangs.

One server with small limits (and an API key, CORS for one origin) serves the whole module.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
LONG = {"prompt": "a blue square", "num_inference_steps": 1000, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def server(server_factory):
    handle = server_factory(
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "1",
        "--kv-cache-memory-bytes",
        "32M",
        "--max-request-body-bytes",
        "4096",
        "--max-prompt-chars",
        "300",
        "--max-error-message-chars",
        "200",
        "--max-header-count",
        "30",
        "--max-header-bytes",
        "4096",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--request-timeout",
        "60",
        "--api-key",
        KEY,
        "--allowed-origins",
        ORIGIN,
    )
    yield handle
    handle.stop()


def _post(server, body: dict | None = None, *, timeout: float = 60.0, **kwargs) -> httpx.Response:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    if body is not None:
        kwargs["json"] = body
    return httpx.post(f"{server.url}/v1/images/generations", headers=headers, timeout=timeout, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _raw(server, data: bytes, *, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes; return everything the server sent until it closed, and how long that took."""
    host, port = server.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        if data:
            sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


def _json_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_api_key_is_required_on_v1_routes(server) -> None:
    error = _error(httpx.get(f"{server.url}/v1/models", timeout=10), 401)
    assert error["code"] == "invalid_api_key"
    _error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # probes need no key


def test_cors_preflight_answers_the_allowed_origin_only(server) -> None:
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    response = httpx.options(f"{server.url}/v1/images/generations", headers=headers, timeout=10)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{server.url}/v1/images/generations", headers={**headers, "Origin": "http://evil.example"}, timeout=10
    )
    assert "access-control-allow-origin" not in other.headers


def test_host_header_is_checked_and_never_reflected(server) -> None:
    error = _error(httpx.get(f"{server.url}/health", headers={"Host": "evil.example"}, timeout=10), 400)
    assert error["code"] == "invalid_host"
    assert httpx.get(f"{server.url}/health", headers={"Host": "localhost:1234"}, timeout=10).status_code == 200
    response = httpx.get(f"{server.url}/health/", headers={"Host": "127.0.0.1"}, timeout=10)
    assert response.status_code == 404 and "location" not in response.headers


def test_docs_are_off_and_the_playground_sends_csp_and_frame_headers(server) -> None:
    assert httpx.get(f"{server.url}/docs", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/openapi.json", timeout=10).status_code == 200
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "'sha256-" in policy
    assert page.headers["x-frame-options"] == "DENY"


def test_body_size_is_bounded(server) -> None:
    big = {"prompt": "a red circle", "user": "x" * 10_000}
    assert _error(_post(server, big), 413)["code"] == "body_too_large"

    def chunks():
        for _ in range(10):
            yield b" " * 1000

    streamed = _post(server, content=chunks(), headers={"content-type": "application/json"})
    assert _error(streamed, 413)["code"] == "body_too_large"


def test_a_body_without_content_type_gets_a_clear_415(server) -> None:
    error = _error(_post(server, content=b'{"prompt": "a red circle"}'), 415)
    assert "Content-Type: application/json" in error["message"]


def test_prompt_length_is_checked_before_tokenizing_and_messages_are_capped(server) -> None:
    error = _error(_post(server, {"prompt": "a" * 301}), 400)
    assert error["param"] == "prompt" and error["code"] == "prompt_too_long"
    error = _error(_post(server, {"prompt": "zz " * 99}), 400)  # 99 unknown words: a long message, capped
    assert error["param"] == "prompt"
    assert len(error["message"]) <= 200 + 60 and "more characters omitted" in error["message"]


def test_seed_plus_n_never_leaves_the_valid_range(server) -> None:
    error = _error(_post(server, {"prompt": "a red circle", "seed": 2**63 - 1, "n": 2}), 400)
    assert error["param"] == "seed" and "n=2" in error["message"]
    assert "9223372036854775808" not in error["message"]


def test_header_count_and_size_are_bounded(server) -> None:
    many = {f"x-h{i}": "v" for i in range(40)}
    assert _error(httpx.get(f"{server.url}/health", headers=many, timeout=10), 431)["code"] == "too_many_headers"
    status, body = _json_of(
        _raw(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * 8000 + b"\r\n\r\n")[0]
    )
    assert status == 431
    # A head still incomplete past the limit is refused by the protocol layer, also as JSON.
    status, body = _json_of(_raw(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * 8000)[0])
    assert status == 431 and body["error"]["code"] == "invalid_http_request"


def test_protocol_errors_are_json(server) -> None:
    status, body = _json_of(_raw(server, b"GARBAGE\r\n\r\n")[0])
    assert status == 400 and body["error"]["code"] == "invalid_http_request"


def test_slow_clients_are_cut_off(server) -> None:
    # Partial headers, a partial body, and a connection that sends nothing: each closed after ~1 s.
    raw, took = _raw(server, b"GET /health HTTP/1.1\r\nHost: local")
    assert _json_of(raw)[0] == 408 and took < 5
    body = b'{"prompt": "a red circle"}'
    raw, took = _raw(
        server,
        b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body[:5],
    )
    status, error = _json_of(raw)
    assert status == 408 and error["error"]["code"] == "body_timeout" and took < 5
    raw, took = _raw(server, b"")
    assert took < 5


def test_a_full_queue_gets_429_with_retry_after(server, tools) -> None:
    # max-num-seqs 1 + max-queued-requests 1: two long requests are held, the third is refused.
    with ThreadPoolExecutor(max_workers=2) as pool:
        held = [pool.submit(_post, server, LONG, timeout=4.0) for _ in range(2)]
        deadline = time.monotonic() + 30
        while (
            tools.metric(server.metrics(), "omni:num_requests_running")
            + tools.metric(server.metrics(), "omni:num_requests_waiting")
            < 2
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        response = _post(server, {"prompt": "a red circle", "num_inference_steps": 1})
        error = _error(response, 429)
        assert error["code"] == "queue_full" and int(response.headers["retry-after"]) >= 1
        for future in held:  # the clients give up; their requests are aborted
            with pytest.raises(httpx.ReadTimeout):
                future.result()
    deadline = time.monotonic() + 20
    while tools.metric(server.metrics(), "omni:kv_cache_blocks_in_use") != 0:
        assert time.monotonic() < deadline, "the aborted requests' blocks were not freed"
        time.sleep(0.05)
    assert _post(server, {"prompt": "a red circle", "num_inference_steps": 1}).status_code == 200


def test_prompts_without_words_or_with_conflicts_get_400_and_reordered_clauses_draw_the_canonical_image(server):
    for text in ("...", "!", ".,!"):
        assert _error(_post(server, {"prompt": text}), 400)["param"] == "prompt"
    error = _error(_post(server, {"prompt": "a red circle on a red background"}), 400)
    assert error["param"] == "prompt" and "red background" in error["message"]
    error = _error(_post(server, {"prompt": "a red circle and a blue square"}), 400)
    assert "a COLOR SHAPE [at the POSITION] [on a COLOR background]" in error["message"]
    body = {"num_inference_steps": 2, "seed": 5}
    canonical = _post(server, {**body, "prompt": "a black square at the top right on a green background"})
    reordered = _post(server, {**body, "prompt": "on a green background, a black square at the top right"})
    assert canonical.status_code == reordered.status_code == 200
    assert canonical.json()["data"] == reordered.json()["data"]
