"""Messages between the API process and the engine process (msgspec msgpack over a pipe).

Every message is a tagged struct, so one decoder per direction turns bytes back
into the right type. Images travel as PNG bytes; the API process base64-encodes them.

One error channel: every request ends in exactly one ``RequestFinished``, and a request that did not
produce images carries a ``RequestError`` whose ``kind`` (a closed ``Literal``) alone decides the HTTP answer
(``omni_server.api.ERROR_STATUS``). The engine reports ``invalid_request``, ``capacity``, ``engine`` and
``aborted``; the API process itself finishes requests with ``unavailable`` (engine dead, restarting or
stalled, server draining) and ``timeout`` (``--request-timeout``), so it never raises across this boundary.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class GenerationParams(msgspec.Struct, frozen=True, kw_only=True):
    """One image request's fields after HTTP validation; ``None`` means the model's default."""

    prompt: str
    negative_prompt: str | None = None
    n: int = 1
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None  # the families' true CFG (with a negative prompt); see family_engine
    seed: int | None = None


# API process -> engine process


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    params: GenerationParams


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


EngineInput = AddRequest | AbortRequest | Shutdown


# engine process -> API process


class SizeRange(msgspec.Struct, frozen=True, kw_only=True):
    """Sizes a family accepts: height and width each a multiple of ``multiple`` in [``min_side``, ``max_side``]."""

    multiple: int
    min_side: int
    max_side: int


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """What clients may ask of the loaded model (for validation, /v1/models and the playground).

    Sizes: the listed ``sizes`` when ``size_range`` is None (the shipped DiT), else any size in ``size_range``
    (``sizes`` then holds the default only). ``accepts`` names the request fields the model uses.
    """

    name: str
    sizes: list[tuple[int, int]]  # supported (height, width)
    default_size: tuple[int, int]
    default_steps: int
    default_guidance_scale: float | None
    max_prompt_tokens: int | None = None
    family: str = "omni-dit"
    variant: str | None = None
    size_range: SizeRange | None = None
    accepts: list[str] = []
    default_true_cfg_scale: float | None = None
    default_negative_prompt: str | None = None
    max_images_per_request: int | None = None
    max_inference_steps: int | None = None

    def size_problem(self, height: int, width: int) -> str | None:
        """Why ``height`` x ``width`` is refused (a message naming the supported sizes), or None if accepted."""
        r = self.size_range
        if r is None:
            if (height, width) in self.sizes:
                return None
            supported = ", ".join(f"{w}x{h}" for h, w in self.sizes)
            return f"size {width}x{height} is not supported by {self.name}; supported sizes: {supported}"
        if all(side % r.multiple == 0 and r.min_side <= side <= r.max_side for side in (height, width)):
            return None
        return (f"size {width}x{height} is not supported by {self.name}: width and height must be multiples of "
                f"{r.multiple} in [{r.min_side}, {r.max_side}]")


class EngineReady(msgspec.Struct, frozen=True, tag=True):
    """Sent once: the model is loaded, profiled, the KV pool sized and the engine warmed up."""

    card: ModelCard
    kv_blocks_total: int
    block_size: int
    pid: int


class EngineStartupFailed(msgspec.Struct, frozen=True, tag=True):
    message: str


ErrorKind = Literal["invalid_request", "capacity", "engine", "aborted", "unavailable", "timeout"]


class RequestError(msgspec.Struct, frozen=True, kw_only=True):
    """Why one request produced no images; ``kind`` maps to one HTTP status in the API process."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None  # a finer OpenAI ``code`` (e.g. ``engine_dead``); the kind's default otherwise


class RequestFinished(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The one answer to a request: ``images`` (one PNG per requested image) or ``error``, never both."""

    request_id: str
    images: list[bytes] = []
    error: RequestError | None = None
    queue_s: float = 0.0  # arrival -> first scheduled
    engine_s: float = 0.0  # arrival -> finished, measured in the engine


class StepProgress(msgspec.Struct, frozen=True, array_like=True):
    """Denoising steps a running request has completed (every image of a request advances together)."""

    request_id: str
    step: int
    total: int


class EngineStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Scheduler state after an engine iteration; step latencies since the last report; progress of the running."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    step_latencies_s: list[float] = []
    progress: list[StepProgress] = []


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """Sent by the engine's heartbeat thread every ``HEARTBEAT_INTERVAL_S``: the process is alive and scheduled."""


HEARTBEAT_INTERVAL_S = 0.1

# A request that names no seed gets one drawn from [0, SEED_DRAW_RANGE) (by the engine, or by rank 0 for workers).
SEED_DRAW_RANGE = 2**31 - 1

# What an engine iteration returns (``Engine.step``); everything else the process sends is lifecycle.
EngineOutput = RequestFinished | EngineStats
EngineMessage = EngineReady | EngineStartupFailed | RequestFinished | EngineStats | Heartbeat

_INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
_OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineMessage)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def decode_input(data: bytes) -> EngineInput:
    return _INPUT_DECODER.decode(data)


def decode_output(data: bytes) -> EngineMessage:
    return _OUTPUT_DECODER.decode(data)
