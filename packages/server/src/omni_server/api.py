"""The OpenAI-compatible HTTP API (FastAPI).

Routes: ``POST /v1/images/generations``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` and the playground page at ``/``. ``/docs`` and ``/redoc`` are off (they load scripts
from a CDN, which an offline machine cannot reach); ``/openapi.json`` is served.

Every error body has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` (``errors``):
400 for an invalid field (``param`` names it), 401 without the API key, 404 for an unknown model or route,
408/413/415/431 for a request the guard refuses (``http_guard``), 429 when the queue is full, 503 while the
engine starts, restarts, is stalled or dead, or while the server drains, 504 after ``--request-timeout``,
500 when the engine fails one request (the server keeps serving). A client that disconnects while its
request waits or runs has the request aborted in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_server.client import EngineClient, EngineStartError
from omni_server.config import ServerConfig
from omni_server.errors import APIError, cap_message, invalid_field
from omni_server.http_guard import HTTPGuard
from omni_server.metrics import ServerMetrics
from omni_server.progress import PROGRESS_HEADER, ProgressBoard, progress_router
from omni_server.protocol import EngineStats, GenerationParams, ModelCard, RequestError, RequestFinished
from omni_server.schemas import (
    MAX_SEED,
    ErrorResponse,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelList,
    model_object,
)

logger = logging.getLogger("omni_server.api")

_STARTED_AT = int(time.time())
_CLIENT_CLOSED_REQUEST = 499  # nginx's convention; the client never sees it


class DrainState:
    """Set once when the server starts draining (SIGTERM/SIGINT): no new work is accepted after that."""

    def __init__(self) -> None:
        self._started = threading.Event()

    def start(self) -> None:
        self._started.set()

    @property
    def draining(self) -> bool:
        return self._started.is_set()


def _error_response(error: APIError, max_chars: int) -> JSONResponse:
    body = {"error": {"message": cap_message(error.message, max_chars), "type": error.type, "param": error.param,
                      "code": error.code}}
    headers = dict(error.headers)
    if error.close:
        headers["connection"] = "close"
    return JSONResponse(status_code=error.status, content=body, headers=headers)


def _unavailable(client: EngineClient) -> APIError:
    return APIError.from_request_error(client.unavailable_error())


def _validation_error(exc: RequestValidationError) -> APIError:
    messages: list[str] = []
    params: list[str] = []
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            return invalid_field(None, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', '')}",
                                 code="invalid_json")
        field = ".".join(location)
        if field:
            params.append(location[0])
            messages.append(f"{field}: {error.get('msg')}")
        elif error.get("type") == "missing":
            messages.append("a JSON request body is required")
        else:
            messages.append(f"request body: {error.get('msg')}")
    return invalid_field(params[0] if params else None, "; ".join(messages) or "invalid request")


def _parse_size(size: str | None, card: ModelCard) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    width, height = (int(part) for part in size.split("x"))
    problem = card.size_problem(height, width)
    if problem is not None:
        raise invalid_field("size", problem)
    return height, width


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or response end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(config: ServerConfig, *, on_engine_failure: Callable[[str], None] | None = None,
               drain: DrainState | None = None) -> FastAPI:
    """Build the app; its lifespan starts the engine process and stops it on shutdown.

    ``drain`` (owned by ``serve``) turns the server away from new work; the app counts its in-flight
    generation requests in ``app.state.in_flight`` so the drain knows when they are done.
    """
    from omni_server.audio import create_audio_app, is_music_model

    if is_music_model(config.model):  # text-to-music: its own routes and in-process pipeline
        return create_audio_app(config)
    drain = drain or DrainState()
    metrics = ServerMetrics(config.model_name)
    progress = ProgressBoard()

    def on_stats(stats: EngineStats) -> None:
        metrics.update_engine(stats)
        progress.update(stats)

    client = EngineClient(config, on_stats=on_stats, on_restart=metrics.engine_restarts.inc)
    client_stopping = threading.Event()
    max_chars = config.max_error_message_chars
    max_accepted = config.max_num_seqs + config.max_queued_requests
    request_timeout = config.request_timeout_s or None

    def watch_start_up() -> None:
        try:
            client.wait_ready(config.engine_start_timeout_s)
        except EngineStartError as exc:
            if on_engine_failure is not None and not client_stopping.is_set():
                on_engine_failure(str(exc))
            return
        logger.info("engine ready (pid %s): %s", client.engine_pid, client.ready_info)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        threading.Thread(target=watch_start_up, name="engine-start-watch", daemon=True).start()
        try:
            yield
        finally:
            client_stopping.set()
            await asyncio.to_thread(client.shutdown)

    # No /docs, /redoc (CDN scripts); no slash redirects (they would reflect the Host header in Location).
    app = FastAPI(title="omni-server", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False,
                  responses={400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    app.state.engine_client = client
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.in_flight = 0
    app.add_middleware(HTTPGuard, config=config, draining=lambda: drain.draining)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it runs first: preflight requests are answered before the guard asks for the key.
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], allow_credentials=False)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, max_chars)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc), max_chars)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})),
                               max_chars)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error",
                                        code="internal_error"), max_chars)

    @app.get("/health", responses={200: {"content": {"application/json": {}}}})
    async def health() -> JSONResponse:
        """Readiness: 200 only while the engine is ready, alive, heard from recently, and the server not draining."""
        if drain.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable",
                           code="server_shutting_down")
        if not client.ready:
            raise _unavailable(client)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.observe_engine(ready=client.ready and not drain.draining, heartbeat_age_s=client.heartbeat_age_s)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        if not client.ready or client.ready_info is None:
            raise _unavailable(client)
        return ModelList(data=[model_object(client.ready_info.card, _STARTED_AT)])

    @app.post("/v1/images/generations", response_model=ImageGenerationResponse)
    async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
        app.state.in_flight += 1
        try:
            return await _generate(body, request)
        finally:
            app.state.in_flight -= 1

    async def _generate(body: ImageGenerationRequest, request: Request) -> Response:
        received = time.monotonic()
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        for name in ("prompt", "negative_prompt"):
            text = getattr(body, name)
            if text is not None and len(text) > config.max_prompt_chars:
                raise invalid_field(name, f"{name} has {len(text)} characters; at most {config.max_prompt_chars} "
                                          "are accepted (--max-prompt-chars)", code="prompt_too_long")
        if body.seed is not None and body.seed > MAX_SEED - (body.n - 1):
            raise invalid_field("seed", f"image i of a request uses seed + i, so with n={body.n} the seed must be at "
                                        f"most 2**63 - 1 - {body.n - 1} = {MAX_SEED - (body.n - 1)}; got seed="
                                        f"{body.seed}: lower seed or n", code="seed_out_of_range")
        if not client.ready or client.ready_info is None:
            metrics.count_finished("unavailable")
            raise _unavailable(client)
        if client.num_in_flight >= max_accepted:
            metrics.count_finished("rejected")
            raise APIError(429, f"the server holds {max_accepted} requests (--max-num-seqs {config.max_num_seqs} "
                           f"running + --max-queued-requests {config.max_queued_requests} queued); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        height, width = _parse_size(body.size, client.ready_info.card)
        params = GenerationParams(
            prompt=body.prompt, negative_prompt=body.negative_prompt, n=body.n, height=height, width=width,
            num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
            true_cfg_scale=body.true_cfg_scale, seed=body.seed,
        )
        request_id, future = client.generate(params)
        progress.track(request.headers.get(PROGRESS_HEADER), request_id)
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({future, disconnect}, timeout=request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            client.abort(request_id)
            raise
        finally:
            disconnect.cancel()
        if not done:
            error = RequestError(kind="timeout", message=f"the request did not finish within "
                                 f"{config.request_timeout_s:g} s (--request-timeout); it was aborted")
            client.finish_with_error(request_id, error)
            progress.finish(request_id, ok=False)
            metrics.count_finished("timeout")
            raise APIError.from_request_error(error)
        if not future.done():
            client.abort(request_id)
            future.cancel()
            progress.finish(request_id, ok=False)
            metrics.count_finished("aborted")
            return _error_response(APIError(_CLIENT_CLOSED_REQUEST, "client closed the request",
                                            type="invalid_request_error", code="client_closed_request"), max_chars)
        result = future.result()
        progress.finish(request_id, ok=result.error is None)
        return _finished_response(result, received, metrics)

    app.include_router(progress_router(progress))
    page_html, page_headers = _playground(config.model_name)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page_html, headers=page_headers)

    return app


def _playground(model_name: str) -> tuple[str, dict[str, str]]:
    """The page and its security headers: a CSP that allows exactly its own inline script and style blocks
    (by hash), images from ``data:`` URLs and requests to this origin; no framing by other sites."""
    page = resources.files("omni_server").joinpath("playground.html").read_text(encoding="utf-8")
    page = page.replace("{{MODEL}}", html.escape(model_name))

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    policy = (f"default-src 'none'; script-src {hashes('script') or chr(39) + 'none' + chr(39)}; "
              f"style-src {hashes('style') or chr(39) + 'none' + chr(39)}; img-src data:; connect-src 'self'; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    headers = {"Content-Security-Policy": policy, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer"}
    return page, headers


def _finished_response(result: RequestFinished, received: float, metrics: ServerMetrics) -> Response:
    metrics.queue_time.observe(result.queue_s)
    if result.error is not None:
        outcome = {"invalid_request": "invalid", "capacity": "invalid", "engine": "error", "aborted": "aborted",
                   "unavailable": "unavailable", "timeout": "timeout"}[result.error.kind]
        metrics.count_finished(outcome)
        raise APIError.from_request_error(result.error)
    data = [ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in result.images]
    response = ImageGenerationResponse(created=int(time.time()), data=data)
    metrics.e2e_time.observe(time.monotonic() - received)
    metrics.count_finished("success")
    return JSONResponse(response.model_dump(exclude_none=True))


def _version() -> str:
    from omni_server import __version__

    return __version__
