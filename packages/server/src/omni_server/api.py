"""The OpenAI-compatible HTTP API (FastAPI).

Routes: ``POST /v1/images/generations``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` and the playground page at ``/``.

Every error body has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``:
400 for an invalid field (``param`` names it), 404 for an unknown model or route,
503 while the engine starts or after it died, 500 when the engine fails one
request (the server keeps serving). A client that disconnects while its request
waits or runs has the request aborted in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_server.client import EngineClient, EngineDeadError, EngineNotReadyError
from omni_server.config import ServerConfig
from omni_server.metrics import ServerMetrics
from omni_server.progress import PROGRESS_HEADER, ProgressBoard, progress_router
from omni_server.protocol import EngineStats, GenerationParams, ModelCard, RequestFinished
from omni_server.schemas import (
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


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def invalid_field(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def _error_response(error: APIError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return JSONResponse(status_code=error.status, content=body)


def _unavailable(client: EngineClient) -> APIError:
    if client.dead:
        return APIError(503, f"the engine is not available: {client.death_reason}", type="service_unavailable",
                        code="engine_dead")
    return APIError(503, "the engine is still starting (loading, profiling or warming up); retry shortly",
                    type="service_unavailable", code="engine_starting")


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


def create_app(config: ServerConfig, *, on_engine_failure: Callable[[str], None] | None = None) -> FastAPI:
    """Build the app; its lifespan starts the engine process and stops it on shutdown."""
    metrics = ServerMetrics(config.model_name)
    progress = ProgressBoard()

    def on_stats(stats: EngineStats) -> None:
        metrics.update_engine(stats)
        progress.update(stats)

    client = EngineClient(config, on_stats=on_stats)

    def watch_start_up() -> None:
        try:
            client.wait_ready(config.engine_start_timeout_s)
        except EngineDeadError as exc:
            if on_engine_failure is not None and not client_stopping.is_set():
                on_engine_failure(str(exc))
            return
        logger.info("engine ready (pid %s): %s", client.engine_pid, client.ready_info)

    client_stopping = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        threading.Thread(target=watch_start_up, name="engine-start-watch", daemon=True).start()
        try:
            yield
        finally:
            client_stopping.set()
            await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="omni-server", version=_version(), lifespan=lifespan,
                  responses={400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    app.state.engine_client = client
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error",
                                        code="internal_error"))

    @app.get("/health", responses={200: {"content": {"application/json": {}}}})
    async def health() -> JSONResponse:
        if not client.ready:
            raise _unavailable(client)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.engine_ready.set(1 if client.ready else 0)  # read at scrape time: never stale
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        if client.ready_info is None:
            raise _unavailable(client)
        return ModelList(data=[model_object(client.ready_info.card, _STARTED_AT)])

    @app.post("/v1/images/generations", response_model=ImageGenerationResponse)
    async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
        received = time.monotonic()
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        if not client.ready or client.ready_info is None:
            metrics.count_finished("unavailable")
            raise _unavailable(client)
        height, width = _parse_size(body.size, client.ready_info.card)
        params = GenerationParams(
            prompt=body.prompt, negative_prompt=body.negative_prompt, n=body.n, height=height, width=width,
            num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
            true_cfg_scale=body.true_cfg_scale, seed=body.seed,
        )
        try:
            request_id, future = client.generate(params)
        except (EngineDeadError, EngineNotReadyError):
            metrics.count_finished("unavailable")
            raise _unavailable(client) from None
        progress.track(request.headers.get(PROGRESS_HEADER), request_id)
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({future, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            client.abort(request_id)
            raise
        finally:
            disconnect.cancel()
        if not future.done():
            progress.finish(request_id, ok=False)
            client.abort(request_id)
            future.cancel()
            metrics.count_finished("aborted")
            return _error_response(APIError(_CLIENT_CLOSED_REQUEST, "client closed the request",
                                            type="invalid_request_error", code="client_closed_request"))
        try:
            result = future.result()
        except EngineDeadError:
            progress.finish(request_id, ok=False)
            metrics.count_finished("unavailable")
            raise _unavailable(client) from None
        progress.finish(request_id, ok=result.error is None and not result.aborted)
        return _finished_response(result, received, metrics)

    app.include_router(progress_router(progress))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        page = resources.files("omni_server").joinpath("playground.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(config.model_name)))

    return app


def _finished_response(result: RequestFinished, received: float, metrics: ServerMetrics) -> Response:
    metrics.queue_time.observe(result.queue_s)
    if result.error is not None:
        error = result.error
        if error.kind == "engine":
            metrics.count_finished("error")
            raise APIError(500, f"the engine failed this request: {error.message}", type="server_error",
                           code="engine_error")
        metrics.count_finished("invalid")
        code = "kv_capacity_exceeded" if error.kind == "capacity" else "invalid_value"
        raise invalid_field(error.param, error.message, code=code)
    if result.aborted:
        metrics.count_finished("aborted")
        raise APIError(500, "the request was aborted in the engine", type="server_error", code="aborted")
    data = [ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in result.images]
    response = ImageGenerationResponse(created=int(time.time()), data=data)
    metrics.e2e_time.observe(time.monotonic() - received)
    metrics.count_finished("success")
    return JSONResponse(response.model_dump(exclude_none=True))


def _version() -> str:
    from omni_server import __version__

    return __version__
