"""Engine iterations over a loaded pipeline, behind one small interface the process loop drives.

``Engine`` is what ``engine_process`` needs: add/abort requests, run one iteration
(``step``), report stats. ``build_engine`` loads the model through ``loader`` and
builds the paged engine (``paged_engine.PagedEngine``: diffusion_kv scheduler,
batched stepwise execution).

Invariant for every engine: each added request produces exactly one
``RequestFinished`` (images or an error, an abort included), and an error in one request never
stops the loop.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from omni_server.config import ConfigError, ServerConfig
from omni_server.schemas import MAX_IMAGES_PER_REQUEST
from omni_server.protocol import (
    EngineOutput,
    EngineReady,
    GenerationParams,
    ModelCard,
    RequestError,
    RequestFinished,
)

R = TypeVar("R")
logger = logging.getLogger("omni_server.engine")


class Engine(Protocol):
    def ready_message(self) -> EngineReady: ...
    def add(self, request_id: str, params: GenerationParams) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[EngineOutput]: ...
    def close(self) -> None: ...


def build_engine(config: ServerConfig) -> Engine:
    """Load the model (load -> quantize/offload), then build, profile and warm up the engine: ``FamilyEngine``
    for a diffusers checkpoint (FLUX.1, Qwen-Image), ``PagedEngine`` for an omni model."""
    from omni_models.hub import is_diffusers_checkpoint, resolve_model_dir

    from omni_server.loader import load_pipeline

    if is_diffusers_checkpoint(resolve_model_dir(config.model)):
        from omni_server.family_engine import FamilyEngine

        if config.world_size > 1:
            raise ConfigError("--cfg-parallel-size / --sequence-parallel-size: the families' engine serves on one GPU "
                              "(omni-server generate runs them on several)")
        return FamilyEngine(load_pipeline(config), config)
    from omni_server.paged_engine import PagedEngine

    requested_memory = None
    if not config.kv_cache_memory_bytes and config.resolved_device().startswith("cuda"):
        # The memory target is fixed before the weights load, so the profile sees them as non-KV memory.
        from diffusion_kv.sizing import requested_device_memory

        requested_memory = requested_device_memory(config.resolved_device(), config.gpu_memory_utilization)
    if config.world_size > 1:
        from omni_server.workers import WorkerGroup

        pipeline = WorkerGroup.start(config)  # rank 0 of one process per GPU; the scheduler stays here
    else:
        pipeline = load_pipeline(config)
    return PagedEngine(pipeline, config, requested_memory=requested_memory)


DIT_REQUEST_FIELDS = ("prompt", "negative_prompt", "size", "num_inference_steps", "guidance_scale", "n", "seed")


def model_card(pipeline: Any, served_name: str) -> ModelCard:
    """Describe the loaded model from ``Pipeline.info`` for validation and /v1/models."""
    info = pipeline.info
    sizes = [(int(h), int(w)) for h, w in info.supported_sizes]
    return ModelCard(
        name=served_name,
        sizes=sizes,
        default_size=sizes[0],
        default_steps=int(info.default_steps),
        default_guidance_scale=float(info.default_guidance),
        max_prompt_tokens=int(info.max_prompt_tokens),
        family="omni-dit",
        variant=str(info.name),
        accepts=list(DIT_REQUEST_FIELDS),
        max_images_per_request=MAX_IMAGES_PER_REQUEST,
        max_inference_steps=int(info.max_inference_steps),
    )


def encode_png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def request_error(exc: BaseException) -> RequestError:
    """Classify one request's failure: the model's ``InvalidRequestError`` is the client's fault."""
    from omni_models import InvalidRequestError

    if isinstance(exc, InvalidRequestError):
        return RequestError(kind="invalid_request", message=str(exc), param=exc.param)
    return RequestError(kind="engine", message=f"{type(exc).__name__}: {exc}")


def fault_injection_hook() -> Callable[[GenerationParams], None]:
    """Test-only fault injection, off unless ``OMNI_SERVER_FAULT_PROMPT`` is set in the engine's environment.

    A request whose prompt equals that value raises in every forward that includes it, which lets the
    end-to-end tests prove that one failing request gets a 500 and the server lives on.
    """
    trigger = os.environ.get("OMNI_SERVER_FAULT_PROMPT")

    def check(params: GenerationParams) -> None:
        if trigger is not None and params.prompt == trigger:
            raise RuntimeError("injected engine fault (OMNI_SERVER_FAULT_PROMPT)")

    return check


def run_warmup_request(step: Callable[[], list[EngineOutput]], *, timeout_s: float = 600.0) -> None:
    """Drive ``step`` until the already-added warm-up request finishes.

    Raises RuntimeError when it has not finished within ``timeout_s`` seconds or finished with an error.
    Meant for an engine's own warm-up, while no other request has been added.
    """
    deadline = time.monotonic() + timeout_s
    outputs: list[EngineOutput] = []
    while not any(isinstance(o, RequestFinished) for o in outputs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up request did not finish within {timeout_s:g} s")
        outputs += step()
    finished = next(o for o in outputs if isinstance(o, RequestFinished))
    if finished.error is not None:
        raise RuntimeError(f"warm-up request failed: {finished.error.message}")


def forward_isolating_failures(requests: Sequence[R], forward: Callable[[Sequence[R]], None],
                               fail: Callable[[R, Exception], None]) -> None:
    """``forward(requests)`` as one batch; if it raises, each request again on its own, so only the culprit
    ``fail``s and the engine lives on.

    Retrying is safe even when the batch raised after stepping: a job's latents and step index advance together,
    so a job the batch already advanced just takes its next step.
    """
    try:
        forward(requests)
        return
    except Exception as exc:
        if len(requests) == 1:
            fail(requests[0], exc)
            return
        logger.warning("batched forward for %d requests failed (%s); running them one at a time", len(requests), exc)
    for request in requests:
        try:
            forward([request])
        except Exception as exc:
            fail(request, exc)


class Timer:
    """Monotonic timestamps of one request: arrival, first scheduled."""

    __slots__ = ("arrival", "scheduled")

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.scheduled: float | None = None

    def mark_scheduled(self) -> None:
        if self.scheduled is None:
            self.scheduled = time.monotonic()

    def finished(
        self, request_id: str, *, images: Iterable[bytes] = (), error: RequestError | None = None
    ) -> RequestFinished:
        now = time.monotonic()
        scheduled = self.scheduled if self.scheduled is not None else now
        return RequestFinished(
            request_id=request_id,
            images=list(images),
            error=error,
            queue_s=scheduled - self.arrival,
            engine_s=now - self.arrival,
        )
