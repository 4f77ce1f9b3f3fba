"""The OpenAI-compatible HTTP API: one app and one guard for every model kind and every route.

Routes (each behind ``http_guard``: limits, auth, Host and content-type rules, drain): ``POST
/v1/images/generations`` (``omni_server.images``), ``POST /v1/images/edits`` (``omni_server.edits``, multipart),
``POST /v1/audio/speech`` (``omni_server.audio``), the videos API (``omni_server.videos``: ``POST /v1/videos``,
multipart or JSON; ``GET /v1/videos[/{id}[/content]]``, ``DELETE /v1/videos/{id}``), ``GET /v1/models`` and ``GET
/v1/models/{id}`` (the base model and its LoRA adapters, each with ``parent``), ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``omni_server.lora_api``), ``GET /v1/progress/{key}``, ``GET /health``, ``GET
/metrics``, and the playground at ``/`` (the image or the music page, by the model's task). ``/docs`` and
``/redoc`` are off (they load scripts from a CDN, which an offline machine cannot reach); ``/openapi.json`` is
served.

A route builds the one request type (``omni_models.GenerationRequest``), checks it once against the model's
``ModelInfo`` (``ServerState.resolve``: 400 naming the field) and hands it to ``ServerState.run``, which owns
what every generation shares: readiness (503), the queue bound (429), ``--request-timeout`` (504), the
disconnect abort (the request is aborted in the engine, which frees what it holds), progress and metrics.

Every error body has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` (``errors``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html
import logging
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_models import GenerationRequest, InvalidRequestError, ModelInfo, ResolvedRequest, resolve_request
from omni_server.client import EngineClient, EngineProcess, EngineStartError
from omni_server.config import LoRAModule, ServerConfig
from omni_server.errors import APIError, error_response, invalid_field
from omni_server.http_guard import install_guards
from omni_server.metrics import ServerMetrics
from omni_server.progress import PROGRESS_HEADER, ProgressBoard, progress_router
from omni_server.protocol import EngineStats, RequestError, RequestFinished
from omni_server.schemas import ErrorResponse, ModelList, ModelObject, model_object

logger = logging.getLogger("omni_server.api")

_STARTED_AT = int(time.time())
_CLIENT_CLOSED_REQUEST = 499  # nginx's convention; the client never sees it
_OUTCOMES = {
    "invalid_request": "invalid",
    "capacity": "invalid",
    "engine": "error",
    "aborted": "aborted",
    "unavailable": "unavailable",
    "timeout": "timeout",
}


class DrainState:
    """Set once when the server starts draining (SIGTERM/SIGINT): no new work is accepted after that."""

    def __init__(self) -> None:
        self._started = threading.Event()

    def start(self) -> None:
        self._started.set()

    @property
    def draining(self) -> bool:
        return self._started.is_set()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or response end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ServerState:
    """What every route shares (see the module docstring)."""

    def __init__(
        self,
        config: ServerConfig,
        client: EngineClient,
        metrics: ServerMetrics,
        progress: ProgressBoard,
        drain: DrainState,
    ) -> None:
        self.config, self.client, self.metrics, self.progress, self.drain = config, client, metrics, progress, drain
        self.in_flight = 0
        self._max_accepted = config.max_num_seqs + config.max_queued_requests
        # The stream requests without a seed draw theirs from (``--seed``), in ``resolve_request``.
        self._seeds = random.Random(config.seed)
        self._default_cache = config.default_step_cache()  # --step-cache, --step-cache-config

    def unavailable(self) -> APIError:
        return APIError.from_request_error(self.client.unavailable_error())

    def info(self) -> ModelInfo:
        """The served model's ``ModelInfo``; 503 while the engine is not ready."""
        ready = self.client.ready_info
        if not self.client.ready or ready is None:
            raise self.unavailable()
        return ready.info

    def adapters(self) -> list[LoRAModule]:
        """The LoRA adapters served now (``--lora-modules`` and runtime loads)."""
        return self.client.lora_modules if self.config.enable_lora else []

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 naming ``model`` for anything else."""
        if model is None or model == self.config.model_name:
            return None
        if any(adapter.name == model for adapter in self.adapters()):
            return model
        names = ", ".join(repr(n) for n in [self.config.model_name, *(a.name for a in self.adapters())])
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {names}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    def check_task(self, task: str, route: str) -> None:
        """400 naming ``model`` when the served model does not do what ``route`` asks."""
        info = self.info()
        if info.task != task:
            raise invalid_field(
                "model",
                f"{route} needs a {task} model; {self.config.model_name!r} is a {info.task} model",
                code="model_not_supported",
            )

    def check_text(self, param: str, text: str | None) -> None:
        if text is not None and len(text) > self.config.max_prompt_chars:
            raise invalid_field(
                param,
                f"{param} has {len(text)} characters; at most {self.config.max_prompt_chars} "
                "are accepted (--max-prompt-chars)",
                code="prompt_too_long",
            )

    def resolve(self, request: GenerationRequest, params: dict[str, str] | None = None) -> ResolvedRequest:
        """``request`` checked against the served model (the one check); 400 naming the field, renamed by
        ``params`` (request field -> the route's body field) where the route names it differently."""
        try:
            return resolve_request(self.info(), request, rng=self._seeds, default_cache=self._default_cache)
        except InvalidRequestError as exc:
            raise invalid_field((params or {}).get(exc.param, exc.param), str(exc)) from None

    async def run(
        self, resolved: ResolvedRequest, http: Request, params: dict[str, str] | None = None
    ) -> RequestFinished:
        """Run one request in the engine; the finished request, or an ``APIError`` (every failure counted). A
        client that disconnects aborts it."""
        state = http.app.state
        state.in_flight += 1
        try:
            received = time.monotonic()
            request_id, future = self.submit(resolved)
            self.progress.track(http.headers.get(PROGRESS_HEADER), request_id)
            return await self.wait(request_id, future, received, disconnect=_wait_for_disconnect(http), params=params)
        finally:
            state.in_flight -= 1

    def submit(self, resolved: ResolvedRequest) -> tuple[str, asyncio.Future[RequestFinished]]:
        """Hand ``resolved`` to the engine: its id and the future of its answer; 503 while the engine is not ready,
        429 while the server holds ``--max-num-seqs`` + ``--max-queued-requests`` requests (both counted)."""
        client, metrics, config = self.client, self.metrics, self.config
        if not client.ready or client.ready_info is None:
            metrics.count_finished("unavailable")
            raise self.unavailable()
        if client.num_in_flight >= self._max_accepted:
            metrics.count_finished("rejected")
            raise APIError(
                429,
                f"the server holds {self._max_accepted} requests (--max-num-seqs {config.max_num_seqs} "
                f"running + --max-queued-requests {config.max_queued_requests} queued); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return client.generate(resolved)

    async def wait(
        self,
        request_id: str,
        future: asyncio.Future[RequestFinished],
        received: float,
        *,
        disconnect: Awaitable[None] | None = None,
        params: dict[str, str] | None = None,
    ) -> RequestFinished:
        """The answer of a submitted request, within ``--request-timeout``; ``disconnect`` (the client went away)
        or cancelling the caller aborts it in the engine, which frees what it holds. Every outcome is counted."""
        client, metrics, config = self.client, self.metrics, self.config
        params = params or {}
        watched = asyncio.ensure_future(disconnect) if disconnect is not None else None
        try:
            done, _ = await asyncio.wait(
                {future} | ({watched} if watched is not None else set()),
                timeout=config.request_timeout_s or None,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except asyncio.CancelledError:
            client.abort(request_id)
            self.progress.finish(request_id, ok=False)
            metrics.count_finished("aborted")
            raise
        finally:
            if watched is not None:
                watched.cancel()
        if not done:
            error = RequestError(
                kind="timeout",
                message=f"the request did not finish within "
                f"{config.request_timeout_s:g} s (--request-timeout); it was aborted",
            )
            client.finish_with_error(request_id, error)
            self.progress.finish(request_id, ok=False)
            metrics.count_finished("timeout")
            raise APIError.from_request_error(error)
        if not future.done():
            client.abort(request_id)
            future.cancel()
            self.progress.finish(request_id, ok=False)
            metrics.count_finished("aborted")
            raise APIError(
                _CLIENT_CLOSED_REQUEST,
                "client closed the request",
                type="invalid_request_error",
                code="client_closed_request",
            )
        result = future.result()
        self.progress.finish(request_id, ok=result.error is None)
        metrics.queue_time.observe(result.queue_s)
        if result.error is not None:
            metrics.count_finished(_OUTCOMES[result.error.kind])
            error = result.error
            if error.param in params:
                error = msgspec.structs.replace(error, param=params[error.param])
            raise APIError.from_request_error(error)
        metrics.e2e_time.observe(time.monotonic() - received)
        metrics.observe_step_cache(result)
        metrics.count_finished("success")
        return result


def _validation_error(exc: RequestValidationError) -> APIError:
    messages: list[str] = []
    params: list[str] = []
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            return invalid_field(
                None,
                f"the request body is not valid JSON: {error.get('ctx', {}).get('error', '')}",
                code="invalid_json",
            )
        field = ".".join(location)
        if field:
            params.append(location[0])
            messages.append(f"{field}: {error.get('msg')}")
        elif error.get("type") == "missing":
            messages.append("a JSON request body is required")
        else:
            messages.append(f"request body: {error.get('msg')}")
    return invalid_field(params[0] if params else None, "; ".join(messages) or "invalid request")


def _install_error_handlers(app: FastAPI, max_chars: int) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, max_chars)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc), max_chars)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return error_response(error, max_chars)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(
            APIError(500, f"internal server error: {type(exc).__name__}", type="server_error", code="internal_error"),
            max_chars,
        )


def service_router(state: ServerState) -> APIRouter:
    """``/health``, ``/metrics`` and the model list."""
    router = APIRouter()

    @router.get("/health", responses={200: {"content": {"application/json": {}}}})
    async def health() -> JSONResponse:
        """Readiness: 200 only while the engine is ready, alive, heard from recently, and the server not draining."""
        if state.drain.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="server_shutting_down")
        state.info()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        client = state.client
        state.metrics.observe_engine(
            ready=client.ready and not state.drain.draining, heartbeat_age_s=client.heartbeat_age_s
        )
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def entries(info: ModelInfo) -> dict[str, ModelObject]:
        base = model_object(info, state.config.model_name, _STARTED_AT)
        adapters = {
            a.name: base.model_copy(update=dict(id=a.name, parent=base.id, root=a.path)) for a in state.adapters()
        }
        return {base.id: base, **adapters}

    @router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
    async def list_models() -> ModelList:
        return ModelList(data=list(entries(state.info()).values()))

    @router.get("/v1/models/{model_id:path}", response_model=ModelObject, response_model_exclude_none=True)
    async def retrieve_model(model_id: str) -> ModelObject:
        info = state.info()
        state.check_model(model_id)
        return entries(info)[model_id]

    return router


def playground_router(state: ServerState) -> APIRouter:
    """``/``: the playground of the served model's task, sent once the engine says what the model is."""
    router = APIRouter()
    pages: dict[str, tuple[str, dict[str, str]]] = {}

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        task = state.info().task
        if task not in pages:
            name = {"text-to-music": "audio_playground.html", "text-to-video": "video_playground.html"}.get(
                task, "playground.html"
            )
            pages[task] = _page(name, state.config.model_name)
        page, headers = pages[task]
        return HTMLResponse(page, headers=headers)

    return router


def _page(file_name: str, model_name: str) -> tuple[str, dict[str, str]]:
    """A playground page and its security headers: a CSP that allows exactly its own inline script and style
    blocks (by hash), images from ``data:`` URLs, audio and video from ``blob:`` URLs and requests to this origin; no
    framing by other sites."""
    page = resources.files("omni_server").joinpath(file_name).read_text(encoding="utf-8")
    page = page.replace("{{MODEL}}", html.escape(model_name))

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    none = "'none'"
    policy = (
        f"default-src 'none'; script-src {hashes('script') or none}; style-src {hashes('style') or none}; "
        "img-src data:; media-src blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    return page, headers


def create_app(
    config: ServerConfig,
    *,
    on_engine_failure: Callable[[str], None] | None = None,
    drain: DrainState | None = None,
    engine: EngineProcess | None = None,
) -> FastAPI:
    """Build the app; its lifespan starts the engine process (``engine``: one ``prestart_engine`` spawned) and stops
    it on shutdown.

    ``drain`` (owned by ``serve``) turns the server away from new work; the app counts its in-flight
    generation requests in ``app.state.in_flight`` so the drain knows when they are done.
    """
    from omni_server.audio import speech_router
    from omni_server.edits import EDITS_PATH, edits_router
    from omni_server.images import images_router
    from omni_server.lora_api import lora_router
    from omni_server.videos import VIDEOS_PATH, VideoJobs, videos_router

    drain = drain or DrainState()
    metrics = ServerMetrics(config.model_name)
    progress = ProgressBoard()

    def on_stats(stats: EngineStats) -> None:
        metrics.update_engine(stats)
        progress.update(stats)
        videos.update(stats)

    client = EngineClient(
        config,
        on_stats=on_stats,
        on_restart=metrics.engine_restarts.inc,
        on_dead=on_engine_failure,
        prestarted=engine,
    )
    state = ServerState(config, client, metrics, progress, drain)
    videos = VideoJobs(state)  # reads --video-dir back: the videos kept from before this start
    client_stopping = threading.Event()

    def watch_start_up() -> None:
        try:
            client.wait_ready(config.engine_start_timeout_s)
        except EngineStartError as exc:
            if on_engine_failure is not None and not client_stopping.is_set():
                on_engine_failure(str(exc))  # a start timeout (a failed start reports through on_dead too)
            return
        logger.info("engine ready (pid %s): %s", client.engine_pid, client.ready_info)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        threading.Thread(target=watch_start_up, name="engine-start-watch", daemon=True).start()
        videos.start_sweeper()
        try:
            yield
        finally:
            videos.stop()
            client_stopping.set()
            await asyncio.to_thread(client.shutdown)

    # No /docs, /redoc (CDN scripts); no slash redirects (they would reflect the Host header in Location).
    app = FastAPI(
        title="omni-server",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
        responses={400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
    )
    app.state.engine_client = client
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.in_flight = 0
    app.state.server = state
    app.state.videos = videos
    install_guards(app, config, draining=lambda: drain.draining, multipart_paths=(EDITS_PATH, VIDEOS_PATH))
    _install_error_handlers(app, config.max_error_message_chars)
    for router in (
        service_router(state),
        images_router(state),
        edits_router(state),
        speech_router(state),
        lora_router(state),
        videos_router(state, videos),
        progress_router(progress),
        playground_router(state),
    ):
        app.include_router(router)
    return app


def _version() -> str:
    from omni_server import __version__

    return __version__
