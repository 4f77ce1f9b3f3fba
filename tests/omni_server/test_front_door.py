"""The front door, end to end on loopback: every client sees every answer, in the OpenAI shape.

- A client that writes its whole body before reading (Python's blocking ``http.client``) reads the 413 of an
  oversized body: the server answers, then discards what the client still sends (bounded in bytes and time).
- A half-closed client (``SHUT_WR`` after a complete request) gets its answer; one that closes still has its
  request aborted.
- ``Content-Length`` with ``Transfer-Encoding``: refused and the connection closed (RFC 9112 §6.3).
- CORS refusals are OpenAI-shaped; the ``Bearer`` scheme is case-insensitive; every response carries an
  ``x-request-id``; ``x-should-retry`` tells the OpenAI SDK which refusals a retry can help.
- An engine that dies past ``--engine-restarts`` ends the API process with a non-zero status.
- ``install_guards`` puts every route of an app behind the guard (``unguarded_routes`` checks it) and admits
  ``multipart/form-data`` on the paths that ask for it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI, Request, WebSocket

KEY = "front-door-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
LONG = {"prompt": "a blue square", "num_inference_steps": 1000, "guidance_scale": 1.0}
SHORT = {"prompt": "a red circle", "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 3}
REQUEST_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 7.0  # > uvicorn's keep-alive timeout (5 s)
GENERATED_ID = re.compile(r"req_[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(server_factory):
    flags = (
        f"--max-num-seqs 1 --max-queued-requests 0 --kv-cache-memory-bytes 32M --request-timeout {REQUEST_TIMEOUT_S} "
        f"--body-timeout {BODY_TIMEOUT_S} --header-timeout 1 --api-key {KEY} --allowed-origins {ORIGIN}"
    )
    handle = server_factory(*flags.split())
    yield handle
    handle.stop()


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _wait_idle(server, tools, timeout_s: float = 20.0) -> None:
    """Until no request runs and every KV block is back (the previous test's requests are gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = server.metrics()
        if (
            tools.metric(text, "omni:num_requests_running") == 0
            and tools.metric(text, "omni:kv_cache_blocks_in_use") == 0
        ):
            return
        assert time.monotonic() < deadline, "requests still running or blocks still in use"
        time.sleep(0.05)


def _responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every response in ``raw`` (interim 1xx ones included), as (status, lower-case headers, body)."""
    parsed = []
    while raw:
        head, separator, rest = raw.partition(b"\r\n\r\n")
        assert separator, f"an incomplete response head: {raw[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", "0"))
        parsed.append((int(status_line.split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return parsed


def _exchange(server, data: bytes, *, half_close: bool = False, timeout: float = 30.0) -> tuple[bytes, bool]:
    """Send raw bytes (then ``SHUT_WR`` if asked); return what came back and whether the server closed."""
    with socket.create_connection(_address(server), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except socket.timeout:
            return received, False
        return received, True


def _head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]).encode()


# -- the 413 of a body written before reading --------------------------------------------------------------------------


def _blocking_post(server, body, **request_args) -> tuple[int, dict[str, str], bytes] | str:
    """POST with the standard library's blocking client: it writes the whole body, then reads."""
    connection = http.client.HTTPConnection(*_address(server), timeout=60)
    try:
        connection.request(
            "POST",
            "/v1/images/generations",
            body=body,
            headers={"Content-Type": "application/json", **AUTH},
            **request_args,
        )
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()


@pytest.mark.parametrize("mib", [4, 16])
def test_a_client_that_writes_its_whole_body_first_reads_the_413(server, mib: int) -> None:
    body = b"x" * (mib * 2**20)
    outcomes = [_blocking_post(server, body) for _ in range(10)]
    statuses = [outcome[0] if isinstance(outcome, tuple) else outcome for outcome in outcomes]
    assert statuses == [413] * 10, statuses
    status, headers, payload = outcomes[0]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert json.loads(payload)["error"]["code"] == "body_too_large"
    # A chunked body over the limit (refused while it is read) is answered the same way.
    chunked = _blocking_post(server, iter([b"x" * 2**20] * mib), encode_chunked=True)
    assert isinstance(chunked, tuple) and chunked[0] == 413, chunked


def _oversized_head() -> bytes:
    return _head(
        "POST",
        "/v1/images/generations",
        "Content-Type: application/json",
        f"Authorization: Bearer {KEY}",
        f"Content-Length: {2**30}",
    )


def test_the_discarding_after_a_413_ends_after_the_body_timeout(server) -> None:
    # Declares 1 GiB and trickles it: it reads the 413 at once, and the server closes after --body-timeout
    # (longer than uvicorn's 5 s keep-alive timeout, which must not cut it short).
    with socket.create_connection(_address(server), timeout=30) as sock:
        sock.sendall(_oversized_head() + b"x" * 2**20)
        started = time.monotonic()
        received = b""
        while chunk := sock.recv(65536):  # the 413, then the server's half-close
            received += chunk
        assert [status for status, _, _ in _responses(received)] == [413]
        with pytest.raises(OSError):
            while time.monotonic() - started < BODY_TIMEOUT_S + 10:
                sock.sendall(b"x" * 2**16)
                time.sleep(0.2)
        cut_after = time.monotonic() - started
    assert BODY_TIMEOUT_S - 0.5 < cut_after < BODY_TIMEOUT_S + 3, cut_after


def test_the_discarding_after_a_413_ends_after_64_mib(server) -> None:
    # Never stops sending: cut off once the server has discarded its bound (64 MiB), long before 1 GiB.
    sent = 0
    with socket.create_connection(_address(server), timeout=30) as sock:
        sock.sendall(_oversized_head())
        block = b"x" * 2**20
        with pytest.raises(OSError):
            while sent < 2**30:
                sock.sendall(block)
                sent += len(block)
    assert 64 * 2**20 <= sent < 2**30 / 2, sent


# -- half-closed clients -----------------------------------------------------------------------------------------------


def test_a_half_closed_client_gets_its_answer(server, tools) -> None:
    _wait_idle(server, tools)
    body = json.dumps(SHORT).encode()
    raw, closed = _exchange(
        server,
        _head(
            "POST",
            "/v1/images/generations",
            "Content-Type: application/json",
            f"Authorization: Bearer {KEY}",
            f"Content-Length: {len(body)}",
        )
        + body,
        half_close=True,
    )
    responses = _responses(raw)
    assert responses, "the half-closed client got no answer"
    *interim, (status, headers, payload) = responses
    assert all(code == 100 for code, _, _ in interim), responses
    assert status == 200, payload
    assert len(json.loads(payload)["data"]) == 1
    assert closed  # answered, then closed
    raw, _ = _exchange(server, _head("GET", "/health"), half_close=True)
    assert _responses(raw)[-1][0] == 200


def test_a_client_that_closes_still_has_its_request_aborted(server, tools) -> None:
    _wait_idle(server, tools)
    body = json.dumps(LONG).encode()
    with socket.create_connection(_address(server), timeout=10) as sock:
        sock.sendall(
            _head(
                "POST",
                "/v1/images/generations",
                "Content-Type: application/json",
                f"Authorization: Bearer {KEY}",
                f"Content-Length: {len(body)}",
            )
            + body
        )
        server.wait_for_running(1)
    closed = time.monotonic()
    _wait_idle(server, tools, timeout_s=REQUEST_TIMEOUT_S)
    assert time.monotonic() - closed < 2.0, "the closed client's request was not aborted promptly"


# -- Content-Length with Transfer-Encoding -----------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server) -> None:
    body = b'{"prompt": "a red circle", "n": 0}'
    smuggled = _head("GET", "/health")  # what a front end framing by Content-Length would take as a 2nd request
    request = (
        _head(
            "POST",
            "/v1/images/generations",
            "Content-Type: application/json",
            f"Authorization: Bearer {KEY}",
            f"Content-Length: {len(body)}",
            "Transfer-Encoding: chunked",
        )
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
        + smuggled
    )
    raw, closed = _exchange(server, request, timeout=3)
    responses = _responses(raw)
    assert [status for status, _, _ in responses] == [400], responses
    status, headers, payload = responses[0]
    assert headers["connection"] == "close" and closed
    error = json.loads(payload)["error"]
    assert error["code"] == "invalid_http_request" and "Transfer-Encoding" in error["message"]


# -- CORS refusals, the Bearer scheme ----------------------------------------------------------------------------------


def test_cors_refusals_have_the_openai_error_shape(server) -> None:
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    url = f"{server.url}/v1/images/generations"
    error = _error(httpx.options(url, headers=preflight, timeout=10), 400)
    assert error["code"] == "cors_not_allowed" and "origin" in error["message"]
    assert "--allowed-origins" in error["message"]
    response = httpx.options(
        url, headers={**preflight, "Origin": ORIGIN, "Access-Control-Request-Method": "PUT"}, timeout=10
    )
    error = _error(response, 400)
    assert "method" in error["message"] and error["code"] == "cors_not_allowed"
    allowed = httpx.options(url, headers={**preflight, "Origin": ORIGIN}, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    # A browser page may read the headers that tell a client what to do next.
    simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert simple.status_code == 401
    exposed = {name.strip() for name in simple.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "x-should-retry", "retry-after"} <= exposed


def test_the_bearer_scheme_is_case_insensitive(server) -> None:
    for value in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": value}, timeout=10).status_code == 200
    for value in (f"Basic {KEY}", "bearer wrong", f"bearer{KEY}", KEY):
        response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": value}, timeout=10)
        assert _error(response, 401)["code"] == "invalid_api_key"


# -- x-request-id on every response ------------------------------------------------------------------------------------


def test_every_response_carries_a_request_id(server) -> None:
    sent = {"x-request-id": "trace-42.a_b:c"}
    assert httpx.get(f"{server.url}/health", headers=sent, timeout=10).headers["x-request-id"] == "trace-42.a_b:c"
    first, second = (httpx.get(f"{server.url}/health", timeout=10).headers["x-request-id"] for _ in range(2))
    assert GENERATED_ID.fullmatch(first) and GENERATED_ID.fullmatch(second) and first != second
    for insane in ("a b", "x" * 200, "<script>", ""):
        echoed = httpx.get(f"{server.url}/health", headers={"x-request-id": insane}, timeout=10)
        assert GENERATED_ID.fullmatch(echoed.headers["x-request-id"]), insane
    answers = [
        httpx.get(f"{server.url}/v1/models", headers=sent, timeout=10),  # 401 from the guard
        httpx.get(f"{server.url}/no-such-route", headers=sent, timeout=10),  # 404 from the router
        httpx.post(
            f"{server.url}/v1/images/generations", headers={**AUTH, **sent}, content=b"x" * 2**21, timeout=10
        ),  # 413, refused unread
        httpx.options(
            f"{server.url}/v1/images/generations",
            timeout=10,
            headers={**sent, "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        ),
    ]
    assert [response.status_code for response in answers] == [401, 404, 413, 400]
    assert all(response.headers["x-request-id"] == "trace-42.a_b:c" for response in answers)
    # Protocol errors (no request was parsed) and a head that never completes get a fresh one.
    for data in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1"):
        raw, _ = _exchange(server, data, timeout=10)
        status, headers, _ = _responses(raw)[0]
        assert status in (400, 408) and GENERATED_ID.fullmatch(headers["x-request-id"]), raw


# -- x-should-retry ----------------------------------------------------------------------------------------------------


def test_x_should_retry_says_which_refusals_a_retry_can_help(server, tools) -> None:
    final = [
        httpx.post(
            f"{server.url}/v1/images/generations", headers=AUTH, json={"prompt": "a red circle", "n": 0}, timeout=10
        ),  # 400
        httpx.post(f"{server.url}/v1/images/generations", headers=AUTH, content=b"x" * 2**21, timeout=10),  # 413
        httpx.post(f"{server.url}/v1/images/generations", headers=AUTH, content=b"{}", timeout=10),  # 415
        httpx.get(f"{server.url}/v1/models", timeout=10),  # 401
    ]
    assert [response.status_code for response in final] == [400, 413, 415, 401]
    assert all(response.headers["x-should-retry"] == "false" for response in final)

    _wait_idle(server, tools)
    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(httpx.post, f"{server.url}/v1/images/generations", headers=AUTH, json=LONG, timeout=30)
        server.wait_for_running(1)
        full = httpx.post(f"{server.url}/v1/images/generations", headers=AUTH, json=SHORT, timeout=10)
        assert _error(full, 429)["code"] == "queue_full" and full.headers["x-should-retry"] == "true"
        timed_out = held.result(timeout=REQUEST_TIMEOUT_S + 20)
    assert _error(timed_out, 504)["code"] == "request_timeout"
    assert timed_out.headers["x-should-retry"] == "false"


def test_the_openai_sdk_does_not_retry_a_timed_out_request(server, tools) -> None:
    openai = pytest.importorskip("openai")
    _wait_idle(server, tools)
    before = tools.metric(server.metrics(), "omni:request_finished_total", outcome="timeout")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=2, timeout=60)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.images.generate(prompt=LONG["prompt"], extra_body={k: v for k, v in LONG.items() if k != "prompt"})
    took = time.monotonic() - started
    assert caught.value.status_code == 504
    assert tools.metric(server.metrics(), "omni:request_finished_total", outcome="timeout") - before == 1
    assert took < 2 * REQUEST_TIMEOUT_S, f"{took:.1f} s: the SDK retried"


# -- an engine dead past its restarts ends the server ------------------------------------------------------------------


def test_a_starting_engine_is_retryable_and_one_dead_past_its_restarts_ends_the_server(tmp_path, tools) -> None:
    port = tools.free_port()
    url = f"http://127.0.0.1:{port}"
    model = os.environ.get("OMNI_SERVER_TEST_MODEL")
    model_args = [model, "--served-model-name", "omni-shapes-tiny"] if model else []
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omni_server",
                "serve",
                *model_args,
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-cache-memory-bytes",
                "32M",
                "--max-num-seqs",
                "1",
                "--engine-restarts",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree = [process.pid]
    try:
        starting = None
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "the server never became healthy"
            try:
                health = httpx.get(f"{url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if health.status_code == 200:
                break
            starting = starting or health
            time.sleep(0.1)
        assert starting is not None, "never saw /health while the engine was starting"
        assert _error(starting, 503)["code"] == "engine_starting"
        assert starting.headers["x-should-retry"] == "true"

        tree += tools.child_pids(process.pid)
        engine = next(pid for pid in tree[1:] if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read())
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = pool.submit(httpx.post, f"{url}/v1/images/generations", json=LONG, timeout=30)
            deadline = time.monotonic() + 30
            while tools.metric(httpx.get(f"{url}/metrics", timeout=5).text, "omni:num_requests_running") < 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.05)
            os.kill(engine, signal.SIGKILL)
            answer = in_flight.result(timeout=10)
        assert _error(answer, 503)["code"] == "engine_dead"
        assert answer.headers["x-should-retry"] == "false"
        assert process.wait(30) == 1
        assert "--engine-restarts 0" in log_path.read_text(errors="replace")
        deadline = time.monotonic() + 10
        while any(tools.pid_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(tools.pid_alive(pid) for pid in tree)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


# -- one guard for every route; multipart where a route takes files ----------------------------------------------------


def _serve_in_thread(app, config):
    import uvicorn

    from omni_server.http_protocol import protocol_class

    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, lifespan="off", log_level="warning", http=protocol_class(config)
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, thread


def test_install_guards_puts_every_route_behind_the_guard_and_admits_multipart_where_asked(tools) -> None:
    from omni_server.config import ServerConfig
    from omni_server.http_guard import install_guards, unguarded_routes

    # A form body may hold 4096 + 4 x 1024 bytes (--max-request-body-bytes plus 4 x --max-input-image-bytes).
    config = ServerConfig(
        port=tools.free_port(),
        max_request_body_bytes=4096,
        max_input_image_bytes=1024,
        api_key=KEY,
        allowed_origins=[ORIGIN],
    )

    def build() -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        async def echo(request: Request) -> dict:
            body = await request.body()
            return {"content_type": request.headers.get("content-type"), "bytes": len(body)}

        app.add_api_route("/v1/images/edits", echo, methods=["POST"])
        app.add_api_route("/v1/images/generations", echo, methods=["POST"])
        return app

    app = build()
    assert unguarded_routes(app) == ["/openapi.json", "/v1/images/edits", "/v1/images/generations"]
    install_guards(app, config, draining=lambda: False, multipart_paths={"/v1/images/edits"})
    assert unguarded_routes(app) == []

    with_socket = build()
    install_guards(with_socket, config, draining=lambda: False)

    async def realtime(websocket: WebSocket) -> None:
        await websocket.close()

    with_socket.add_api_websocket_route("/v1/realtime", realtime)
    assert unguarded_routes(with_socket) == ["/v1/realtime"]  # the guard checks HTTP requests only

    server, thread = _serve_in_thread(app, config)
    base = f"http://127.0.0.1:{config.port}"
    try:
        files = {"image": ("a.png", b"\x89PNG" + b"0" * 100, "image/png")}
        edit = httpx.post(f"{base}/v1/images/edits", headers=AUTH, files=files, data={"prompt": "p"}, timeout=10)
        assert edit.status_code == 200, edit.text
        assert edit.json()["content_type"].startswith("multipart/form-data; boundary=")
        assert httpx.post(f"{base}/v1/images/edits", headers=AUTH, json={"prompt": "p"}, timeout=10).status_code == 200
        error = _error(httpx.post(f"{base}/v1/images/generations", headers=AUTH, files=files, timeout=10), 415)
        assert "application/json" in error["message"] and "or a form" not in error["message"]
        error = _error(
            httpx.post(
                f"{base}/v1/images/edits", headers={**AUTH, "Content-Type": "text/plain"}, content=b"p", timeout=10
            ),
            415,
        )
        assert "multipart/form-data" in error["message"]
        big = {"image": ("a.png", b"0" * 8192, "image/png")}
        assert (
            _error(httpx.post(f"{base}/v1/images/edits", headers=AUTH, files=big, timeout=10), 413)["code"]
            == "body_too_large"
        )
        assert _error(httpx.post(f"{base}/v1/images/edits", files=files, timeout=10), 401)["code"] == "invalid_api_key"
        # The CORS it installs answers a refused preflight in the OpenAI shape, with the request id.
        preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        refused = httpx.options(f"{base}/v1/images/edits", headers=preflight, timeout=10)
        assert _error(refused, 400)["code"] == "cors_not_allowed" and "x-request-id" in refused.headers
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("model", ["omni-shapes-tiny", "omni-tones-tiny"])
def test_every_route_of_the_served_app_is_guarded_for_every_model_kind(model: str) -> None:
    """One app for every kind: the image and the music server are the same routes behind the same guard."""
    from omni_server.api import create_app
    from omni_server.config import build_config
    from omni_server.http_guard import unguarded_routes

    app = create_app(build_config(None, model=model, device="cpu"))
    paths = {getattr(route, "path", None) for route in app.router.routes}
    assert {
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/audio/speech",
        "/v1/models",
        "/health",
        "/metrics",
        "/",
    } <= paths
    assert unguarded_routes(app) == []
