"""The OpenAI videos API over the one engine: ``POST /v1/videos``, ``GET /v1/videos[/{id}[/content]]``,
``DELETE /v1/videos/{id}``, so the official SDK's ``client.videos.create / retrieve / list / delete /
download_content`` work unchanged.

A video is a job: ``POST`` checks the request once (``ServerState.resolve``, the one request type), hands it to
the engine (``ServerState.submit``: 503 while it is not ready, 429 when the server is full) and answers at once
with the Video object, ``status: "queued"``. The job's task waits for the engine's answer (``ServerState.wait``:
``--request-timeout``, metrics), while ``GET /v1/videos/{id}`` reports ``in_progress`` and ``progress`` (the
percentage of denoising steps done, from the engine's per-step reports) and then ``completed`` (the MP4 is on disk,
``omni_server.video_store``) or ``failed`` (``error``: code and message). ``DELETE`` of a queued or running job
aborts it in the engine, which frees what the job holds, and removes it; of a finished one, removes its files.

The body is a multipart form (what the SDK sends: every field is text, ``input_reference`` a file part, an object
such as ``cache`` as ``cache[knob]`` parts) or JSON. Fields: OpenAI's ``prompt``, ``model`` (the served name or one
of its LoRA adapters), ``seconds``, ``size`` (``WIDTHxHEIGHT``), ``input_reference`` (refused by a model that
draws from text only), and omni's ``num_frames``, ``fps``, ``num_inference_steps``, ``guidance_scale``,
``guidance_scale_2``, ``negative_prompt``, ``seed``, ``cache``. Any other field is a 400 naming it.

``seconds`` and ``num_frames``: ``num_frames = seconds * fps + 1`` (the video models' convention: 81 frames at
16 fps are a 5 s clip), ``fps`` the request's or the model's default; the count must be one the model draws
(Wan: ``4k + 1``), else a 400 naming ``seconds`` with the nearest that are; given both, they must agree. The Video
object's ``seconds`` is ``(num_frames - 1) / fps``.

Bounds, each a flag: ``--max-video-jobs`` jobs queued or running (429 beyond), ``--max-video-frames`` and
``--max-video-pixels`` (width x height x frames) per job (400), and the store's (``video_store``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile

from omni_models import GenerationRequest, InvalidRequestError, decode_input_image
from omni_server.errors import APIError, invalid_field
from omni_server.protocol import EngineStats, RequestFinished
from omni_server.video_store import (
    FINISHED,
    ID_PATTERN,
    SWEEP_INTERVAL_S,
    VideoError,
    VideoRecord,
    VideoStore,
    new_video_id,
    record_object,
)

logger = logging.getLogger("omni_server.videos")

VIDEOS_PATH = "/v1/videos"
SIZE_PATTERN = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
MAX_SECONDS = 3600.0
LIST_LIMIT = (1, 100, 20)  # smallest, largest, default page size of GET /v1/videos
VARIANTS = ("video", "thumbnail", "spritesheet")


# --- the body: a multipart form (the SDK) or JSON, each field parsed once -------------------------------------------


def _integer(name: str, value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,20}\s*", value):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise invalid_field(name, f"{name} must be an integer, got {str(value)[:40]!r}")


def _number(name: str, value: Any) -> float:
    number = math.nan
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if not math.isfinite(number):
        raise invalid_field(name, f"{name} must be a finite number, got {str(value)[:40]!r}")
    return number


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid_field(name, f"{name} must be a string, got {type(value).__name__}")
    return value


def _size(name: str, value: Any) -> tuple[int, int]:
    match = SIZE_PATTERN.fullmatch(_text(name, value))
    if match is None:
        raise invalid_field(name, f"size must be WIDTHxHEIGHT, e.g. 832x480; got {value[:40]!r}")
    width, height = (int(part) for part in match.groups())
    return height, width


def _form_scalar(text: str) -> Any:
    """A form value inside an object (``cache[threshold]=0.1``): a JSON number, boolean or null, else the text."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
    return value if isinstance(value, (int, float, bool)) or value is None else text


def _cache(name: str, value: Any) -> str | dict[str, Any]:
    if isinstance(value, (str, dict)):
        return value
    raise invalid_field(name, f"{name} must be a preset name or an object of knobs, got {type(value).__name__}")


FIELDS = {
    "prompt": _text,
    "model": _text,
    "seconds": _number,
    "size": _size,
    "num_frames": _integer,
    "fps": _integer,
    "num_inference_steps": _integer,
    "guidance_scale": _number,
    "guidance_scale_2": _number,
    "negative_prompt": _text,
    "seed": _integer,
    "cache": _cache,
}
NAMES = ", ".join([*FIELDS, "input_reference"])


async def read_video_body(request: Request) -> tuple[dict[str, Any], Any]:
    """The parsed fields of a create body and its ``input_reference`` (a file's bytes, a JSON object, or None)."""
    content_type = request.headers.get("content-type", "").lower()
    raw: dict[str, Any] = {}
    reference: Any = None
    if content_type.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=1, max_fields=len(FIELDS) + 32)
        except Exception as exc:  # starlette's MultiPartException / HTTPException: a malformed or oversized form
            detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
            raise invalid_field(None, f"the multipart form cannot be read: {detail}") from None
        try:
            for name, value in form.multi_items():
                base, _, rest = name.partition("[")
                if base == "input_reference":
                    reference = await value.read() if isinstance(value, UploadFile) else {"text": value}
                    continue
                if isinstance(value, UploadFile):
                    raise invalid_field(base, f"{base} must be a text field, got a file")
                if rest:  # cache[threshold]: a knob of an object field
                    if base != "cache" or not rest.endswith("]") or "[" in rest:
                        raise invalid_field(base, f"unknown field {name[:60]!r}; the videos route takes {NAMES}")
                    knobs = raw.setdefault(base, {})
                    if not isinstance(knobs, dict):
                        raise invalid_field(base, f"{base} is given twice")
                    knobs[rest[:-1]] = _form_scalar(value)
                    continue
                if base in raw:
                    raise invalid_field(base, f"{base} is given twice")
                raw[base] = value
        finally:
            await form.close()
    else:
        try:
            body = await request.json()
        except ValueError:
            raise invalid_field(None, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise invalid_field(None, "the request body must be a JSON object")
        reference = body.pop("input_reference", None)
        raw = body
    fields: dict[str, Any] = {}
    for name, value in raw.items():
        parse = FIELDS.get(name)
        if parse is None:
            raise invalid_field(name, f"unknown field {name[:60]!r}; the videos route takes {NAMES}")
        if value is not None:
            fields[name] = parse(name, value)
    if not isinstance(fields.get("prompt"), str) or not fields["prompt"].strip():
        raise invalid_field("prompt", "prompt is required: a non-empty text describing the video")
    return fields, reference


def frames_for(fields: dict[str, Any], limits: Any) -> tuple[int | None, dict[str, str]]:
    """The request's ``num_frames`` (None: the model's default) from ``seconds`` and/or ``num_frames`` at the
    request's ``fps`` (or the model's), and the request field -> body field renames for messages."""
    frames = fields.get("num_frames")
    if "seconds" not in fields:
        return frames, {}
    seconds = fields["seconds"]
    fps = fields.get("fps", limits.default_fps)
    if not 0 < seconds <= MAX_SECONDS or isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise invalid_field("seconds", f"seconds must be in (0, {MAX_SECONDS:g}] at a positive fps, got {seconds:g}")
    from_seconds = round(seconds * fps) + 1
    if frames is not None and frames != from_seconds:
        raise invalid_field(
            "seconds",
            f"seconds={seconds:g} at {fps} fps is {from_seconds} frames (num_frames = seconds * fps + 1), but "
            f"num_frames={frames}; give one of them",
        )
    if limits.num_frames_problem(from_seconds) is not None:
        step = limits.frame_multiple
        low = max((from_seconds - 1) // step * step + 1, 1)
        longest = (limits.max_num_frames - 1) // step * step + 1
        options = sorted({n for n in (low, low + step, longest) if n > 1 and limits.num_frames_problem(n) is None})
        options = [n for n in options if n <= max(low + step, 1)] or [longest]
        shown = " or ".join(f"{(n - 1) / fps:g}" for n in options)
        raise invalid_field(
            "seconds",
            f"seconds={seconds:g} at {fps} fps is {from_seconds} frames (num_frames = seconds * fps + 1), which "
            f"the model does not draw: {limits.num_frames_problem(from_seconds)}; nearest: seconds {shown}",
        )
    return from_seconds, {"num_frames": "seconds"}


# --- the jobs ---------------------------------------------------------------------------------------------------------


class VideoJobs:
    """The jobs of one server: the store, each unfinished job's task, and the engine's progress reports."""

    def __init__(self, state) -> None:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
        self.state = state
        self.config = state.config
        self.store = VideoStore(state.config)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._request_ids: dict[str, str] = {}  # engine request id -> video id, while the job runs
        self._writing: set[str] = set()  # jobs whose answer came and whose file is being written
        self._deleted: set[str] = set()  # deleted while their file was being written
        self._progress_lock = threading.Lock()
        self._progress: dict[str, tuple[int, int]] = {}  # video id -> (step, total), from the engine's reports
        self._sweeper: asyncio.Task[None] | None = None
        self.observe()

    # progress arrives on the engine client's reader thread
    def update(self, stats: EngineStats) -> None:
        with self._progress_lock:
            for item in stats.progress:
                video_id = self._request_ids.get(item.request_id)
                if video_id is not None:
                    self._progress[video_id] = (item.step, item.total)

    def progress(self, record: VideoRecord) -> tuple[str, int]:
        """(status, percentage) of a job now: ``in_progress`` once the engine has reported it running."""
        if record.status in FINISHED:
            return record.status, 100 if record.status == "completed" else 0
        with self._progress_lock:
            reported = self._progress.get(record.id)
        if reported is None:
            return "queued", 0
        step, total = reported
        return "in_progress", min(99, 100 * step // max(total, 1))

    def video_object(self, record: VideoRecord) -> dict[str, Any]:
        status, percent = self.progress(record)
        return record_object(msgspec.structs.replace(record, status=status), percent)

    def observe(self) -> None:
        counts = self.store.counts()
        with self._progress_lock:
            running = sum(1 for video_id in self._tasks if video_id in self._progress)
        counts["in_progress"], counts["queued"] = running, len(self._tasks) - running
        self.state.metrics.observe_videos(counts, self.store.stored_bytes())

    @property
    def active(self) -> int:
        return len(self._tasks)

    def get(self, video_id: str) -> VideoRecord:
        self.store.sweep()
        record = self.store.records.get(video_id) if ID_PATTERN.match(video_id) else None
        if record is None:
            raise APIError(
                404,
                f"no video {video_id[:80]!r} on this server (never created, deleted, or expired)",
                type="invalid_request_error",
                param="video_id",
                code="video_not_found",
            )
        return record

    def start(self, record: VideoRecord, request_id: str, future: asyncio.Future[RequestFinished], app) -> None:  # noqa: ANN001
        received = time.monotonic()
        self._request_ids[request_id] = record.id
        self._tasks[record.id] = asyncio.ensure_future(self._run(record, request_id, future, received, app))
        self.observe()

    async def _run(
        self, record: VideoRecord, request_id: str, future: asyncio.Future[RequestFinished], received: float, app
    ) -> None:  # noqa: ANN001
        app.state.in_flight += 1  # a drain waits for video jobs as for every request
        try:
            try:
                result = await self.state.wait(request_id, future, received)
            except APIError as exc:
                error = VideoError(code=exc.code or "error", message=exc.message, param=exc.param, type=exc.type)
                self._finish(msgspec.structs.replace(record, status="failed", error=error))
                return
            data = result.outputs[0]
            if len(data) > self.config.max_video_storage_bytes:
                error = VideoError(
                    code="video_too_large",
                    message=f"the video has {len(data)} bytes; --max-video-storage-bytes keeps at most "
                    f"{self.config.max_video_storage_bytes}",
                    type="invalid_request_error",
                )
                self._finish(msgspec.structs.replace(record, status="failed", error=error))
                return
            self._writing.add(record.id)
            try:
                await asyncio.shield(asyncio.to_thread(self.store.write_video, record.id, data))
            except OSError as exc:
                error = VideoError(code="storage_error", message=f"cannot write the video: {exc}", type="server_error")
                self._finish(msgspec.structs.replace(record, status="failed", error=error))
                return
            finally:
                self._writing.discard(record.id)
            self._finish(msgspec.structs.replace(record, status="completed", bytes=len(data)))
        finally:
            app.state.in_flight -= 1
            self._tasks.pop(record.id, None)
            self._request_ids.pop(request_id, None)
            with self._progress_lock:
                self._progress.pop(record.id, None)
            if record.id in self._deleted:
                self._deleted.discard(record.id)
                self.store.delete(record.id)
            self.observe()

    def _finish(self, record: VideoRecord) -> None:
        if record.id in self._deleted:
            return
        try:
            self.store.finish(record)
        except OSError as exc:
            logger.error("cannot record video %s: %s", record.id, exc)

    def delete(self, video_id: str) -> None:
        """Abort a queued or running job in the engine (the task's cancellation does it) and remove the job."""
        task = self._tasks.get(video_id)
        if task is not None and video_id in self._writing:
            self._deleted.add(video_id)  # the task removes the file it is writing once written
        elif task is not None:
            task.cancel()
        self.store.delete(video_id)
        self.observe()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start_sweeper(self) -> None:
        async def sweep_forever() -> None:
            while True:
                await asyncio.sleep(SWEEP_INTERVAL_S)
                if self.store.sweep():
                    self.observe()

        self._sweeper = asyncio.ensure_future(sweep_forever())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()


# --- the routes ---------------------------------------------------------------------------------------------------


def _reference_images(jobs: VideoJobs, reference: Any) -> tuple[Any, ...]:
    """``input_reference`` as the request's images: refused by a model that draws from text only; a file upload
    (or a ``data:`` image URL) decoded and checked as the edits route checks an image."""
    if reference is None:
        return ()
    state, config = jobs.state, jobs.config
    info = state.info()
    if "image" not in info.accepts:
        raise invalid_field(
            "input_reference",
            f"{config.model_name!r} ({info.variant}) generates video from text only (no image-to-video); "
            "drop input_reference",
            code="unsupported_value",
        )
    data = reference
    if isinstance(reference, dict):
        url = reference.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
            raise invalid_field(
                "input_reference", "input_reference must be an image file, or an object with a data: image_url"
            )
        import base64
        import binascii

        try:
            data = base64.b64decode(url.split(",", 1)[1], validate=True)
        except (binascii.Error, ValueError):
            raise invalid_field("input_reference", "input_reference.image_url is not valid base64") from None
    try:
        image = decode_input_image(
            data,
            max_bytes=config.max_input_image_bytes,
            max_pixels=config.max_input_image_pixels,
            param="input_reference",
        )
    except InvalidRequestError as exc:
        raise invalid_field("input_reference", str(exc)) from None
    return (image,)


def videos_router(state, jobs: VideoJobs) -> APIRouter:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
    router = APIRouter()
    config = state.config

    def check_bounds(resolved, renames: dict[str, str]) -> None:  # noqa: ANN001 - ResolvedRequest
        frames_param = renames.get("num_frames", "num_frames")
        if resolved.num_frames > config.max_video_frames:
            raise invalid_field(
                frames_param,
                f"{resolved.num_frames} frames; this server draws at most {config.max_video_frames} per video "
                "(--max-video-frames)",
            )
        pixels = resolved.width * resolved.height * resolved.num_frames
        if pixels > config.max_video_pixels:
            raise invalid_field(
                "size",
                f"{resolved.width}x{resolved.height} x {resolved.num_frames} frames is {pixels} pixels; this "
                f"server draws at most {config.max_video_pixels} per video (--max-video-pixels)",
            )

    @router.post(
        VIDEOS_PATH,
        openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {"type": "object"}}}}},
    )
    async def create_video(request: Request) -> Response:
        fields, reference = await read_video_body(request)
        adapter = state.check_model(fields.get("model"))
        for name in ("prompt", "negative_prompt"):
            state.check_text(name, fields.get(name))
        state.check_task("text-to-video", VIDEOS_PATH)
        info = state.info()
        images = await asyncio.to_thread(_reference_images, jobs, reference)
        num_frames, renames = frames_for(fields, info.video)
        height, width = fields.get("size", (None, None))
        resolved = state.resolve(
            GenerationRequest(
                prompt=fields["prompt"],
                negative_prompt=fields.get("negative_prompt", msgspec.UNSET),
                height=height,
                width=width,
                num_inference_steps=fields.get("num_inference_steps"),
                guidance_scale=fields.get("guidance_scale"),
                guidance_scale_2=fields.get("guidance_scale_2"),
                seed=fields.get("seed"),
                cache=fields.get("cache"),
                num_frames=num_frames,
                fps=fields.get("fps"),
                images=images,
                lora=adapter,
            ),
            renames,
        )
        check_bounds(resolved, renames)
        if jobs.active >= config.max_video_jobs:
            state.metrics.count_finished("rejected")
            raise APIError(
                429,
                f"the server holds {config.max_video_jobs} video jobs queued or running (--max-video-jobs); retry "
                "later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "5"},
            )
        created = time.time_ns()
        record = VideoRecord(
            id=new_video_id(),
            model=fields.get("model") or config.model_name,
            prompt=resolved.prompt,
            status="queued",
            created_at=created // 10**9,
            created_ns=created,
            size=f"{resolved.width}x{resolved.height}",
            num_frames=resolved.num_frames,
            fps=resolved.fps,
            seed=resolved.seed,
            num_inference_steps=resolved.num_inference_steps,
        )
        try:
            jobs.store.save(record)
        except OSError as exc:
            raise APIError(
                500,
                f"cannot write to the video directory {str(jobs.store.directory)!r} (--video-dir): {exc.strerror}",
                type="server_error",
                code="storage_error",
            ) from None
        try:
            request_id, future = state.submit(resolved)
        except APIError:
            jobs.store.delete(record.id)
            raise
        jobs.start(record, request_id, future, request.app)
        return JSONResponse(jobs.video_object(record))

    @router.get(VIDEOS_PATH)
    async def list_videos(after: str | None = None, limit: str | None = None, order: str = "desc") -> Response:
        smallest, largest, default = LIST_LIMIT
        count = default if limit is None else _integer("limit", limit)
        if not smallest <= count <= largest:
            raise invalid_field("limit", f"limit must be an integer in [{smallest}, {largest}], got {limit!r}")
        if order not in ("asc", "desc"):
            raise invalid_field("order", f"order must be 'asc' or 'desc', got {order[:40]!r}")
        jobs.store.sweep()
        records = sorted(jobs.store.records.values(), key=lambda r: (r.created_ns, r.id), reverse=order == "desc")
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise invalid_field("after", f"after must be the id of a listed video, got {after[:80]!r}")
            records = records[ids.index(after) + 1 :]
        page = records[:count]
        data = [jobs.video_object(r) for r in page]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
                "has_more": len(records) > count,
            }
        )

    @router.get(VIDEOS_PATH + "/{video_id}")
    async def retrieve_video(video_id: str) -> Response:
        return JSONResponse(jobs.video_object(jobs.get(video_id)))

    @router.get(
        VIDEOS_PATH + "/{video_id}/content",
        response_class=Response,
        responses={200: {"content": {"video/mp4": {}}, "description": "the video (MP4, H.264)"}},
    )
    async def download_video(video_id: str, variant: str = "video") -> Response:
        record = jobs.get(video_id)
        if variant != "video":
            known = variant in VARIANTS
            raise invalid_field(
                "variant",
                f"variant {variant[:40]!r} is {'not kept' if known else 'unknown'}: this server keeps the MP4 "
                "only (variant=video)",
                code="unsupported_value",
            )
        status, percent = jobs.progress(record)
        if status != "completed":
            detail = f"failed ({record.error.message})" if record.error else f"{status} ({percent}%)"
            raise invalid_field(
                "video_id",
                f"video {video_id} is {detail}; its content can be downloaded once its status is completed",
                code="video_not_ready",
            )
        return FileResponse(
            jobs.store.video_path(video_id),
            media_type="video/mp4",
            filename=f"{video_id}.mp4",
            content_disposition_type="inline",
        )

    @router.delete(VIDEOS_PATH + "/{video_id}")
    async def delete_video(video_id: str) -> Response:
        jobs.get(video_id)
        jobs.delete(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    return router


__all__ = ["VIDEOS_PATH", "VideoJobs", "frames_for", "read_video_body", "videos_router"]
