"""Messages between the API process and the engine process (msgspec msgpack over a pipe).

Every message is a tagged struct, so one decoder per direction turns bytes back
into the right type. Outputs travel as encoded files (PNG, WAV, MP4); the API process base64-encodes images.

One error channel: every request ends in exactly one ``RequestFinished``, and a request that did not
produce images carries a ``RequestError`` whose ``kind`` (a closed ``Literal``) alone decides the HTTP answer
(``omni_server.api.ERROR_STATUS``). The engine reports ``invalid_request``, ``capacity``, ``engine`` and
``aborted``; the API process itself finishes requests with ``unavailable`` (engine dead, restarting or
stalled, server draining) and ``timeout`` (``--request-timeout``), so it never raises across this boundary.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from omni_models.request import ResolvedRequest
from omni_models.spec import ModelInfo
from omni_models.step_cache import StepCacheStats

# API process -> engine process


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    """One request, already checked against the model (``omni_models.resolve_request``: defaults and seed set)."""

    request_id: str
    request: ResolvedRequest


class StartLoading(msgspec.Struct, frozen=True, tag=True):
    """The API process's checks of the flags and the model passed: load it. An engine process imports what loading
    needs, then waits for this (or ``Shutdown``) before it reads any weights."""


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class LoadLoRAAdapter(msgspec.Struct, frozen=True, tag=True):
    """Register an adapter file under ``name`` (``POST /v1/load_lora_adapter``); answered by ``LoRAAdapterUpdated``
    with the same ``call_id``."""

    call_id: str
    name: str
    path: str


class UnloadLoRAAdapter(msgspec.Struct, frozen=True, tag=True):
    """Stop serving ``name`` to new requests (requests running with it finish with it)."""

    call_id: str
    name: str


EngineInput = StartLoading | AddRequest | AbortRequest | Shutdown | LoadLoRAAdapter | UnloadLoRAAdapter


# engine process -> API process


class EngineReady(msgspec.Struct, frozen=True, tag=True):
    """Sent once: the model is loaded, profiled, the KV pool sized and the engine warmed up. ``info`` is the loaded
    model's ``ModelInfo`` (the API process checks requests, lists the model and builds the playground from it)."""

    info: ModelInfo
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
    """The one answer to a request: ``outputs`` (one encoded file per output: PNG, WAV or MP4) or
    ``error``, never both."""

    request_id: str
    outputs: list[bytes] = []
    error: RequestError | None = None
    queue_s: float = 0.0  # arrival -> first scheduled
    engine_s: float = 0.0  # arrival -> finished, measured in the engine
    step_cache: list[StepCacheStats] = []  # one per image of a completed request with a step cache


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
    compiled_graphs: int = 0  # graphs torch.compile compiled in the engine process so far
    recompiles_since_ready: int = 0  # of those, compiled after the engine reported ready (0 in steady serving)
    progress: list[StepProgress] = []


class LoRAAdapterUpdated(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The answer to a ``LoadLoRAAdapter``/``UnloadLoRAAdapter``: ``error`` None on success (the engine changed), else
    why not (``invalid_request``: a bad file or name, the engine unchanged). ``load_s``: reading the file."""

    call_id: str
    error: RequestError | None = None
    load_s: float = 0.0


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """Sent by the engine's heartbeat thread every ``HEARTBEAT_INTERVAL_S``: the process is alive and scheduled."""


HEARTBEAT_INTERVAL_S = 0.1

# What an engine iteration returns (``Engine.step``); everything else the process sends is lifecycle.
EngineOutput = RequestFinished | EngineStats
EngineMessage = EngineReady | EngineStartupFailed | RequestFinished | EngineStats | Heartbeat | LoRAAdapterUpdated

_INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
_OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineMessage)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def decode_input(data: bytes) -> EngineInput:
    return _INPUT_DECODER.decode(data)


def decode_output(data: bytes) -> EngineMessage:
    return _OUTPUT_DECODER.decode(data)
