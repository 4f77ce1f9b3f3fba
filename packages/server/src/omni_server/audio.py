"""``POST /v1/audio/speech`` for music models (Music-3-style contract, scaled to the model), over the one engine.

The body's ``input`` is the lyrics and ``instructions`` the caption; they become the one request type (``prompt``:
the caption, ``lyrics``) and run through ``ServerState.run`` like every generation: the same guard, queue bounds,
timeouts, disconnect abort, drain and metrics. The answer is the song as a WAV file. HTTP and the CLI build the
same request, so the same seed gives the same bytes.

The fields OpenAI's SDK sends (``model``, ``input``, ``voice``, ``instructions``, ``response_format``, ``speed``,
``stream_format``) are accepted where their value is what the model does (``voice: "default"``,
``response_format: "wav"``, ``speed: 1.0``, ``stream_format: "audio"``) and refused with a 400 naming the field
otherwise; so are the sampling and reference-audio fields of other speech servers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omni_models import GenerationRequest
from omni_server.errors import APIError, invalid_field

# Sampling is fixed by the model (guidance, top-k, seeded draws): these are refused, never ignored.
REFUSED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")
MANAGED_EXTRA_PARAMS = ("cfg_role", "cfg_pair_id", "cfg_null_prompt")
KNOWN_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "seed",
        "max_new_tokens",
        "response_format",
        "stream",
        "stream_format",
        "voice",
        "speed",
        *REFUSED_SAMPLING_FIELDS,
        "ref_audio",
        "ref_text",
        "language",
        "task_type",
        "extra_params",
    }
)
# The request field -> this route's body field, for messages.
SPEECH_PARAMS = {"prompt": "instructions", "lyrics": "input"}


def _bad(param: str, message: str) -> APIError:
    return invalid_field(param, message)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(
            unknown[0],
            f"unknown field '{unknown[0]}'; the music model accepts input, instructions, seed, "
            "max_new_tokens and response_format",
        )
    if body.get("stream"):
        raise _bad("stream", "'stream' is not supported: the music model answers with one WAV file")
    if body.get("stream_format", "audio") != "audio":
        raise _bad("stream_format", "'stream_format' must be 'audio': the music model answers with one WAV file")
    for name in REFUSED_SAMPLING_FIELDS:
        if name in body:
            raise _bad(name, f"the music model has fixed sampling and does not accept: '{name}'")
    if body.get("voice") not in (None, "", "default"):
        raise _bad("voice", "the music model has no speaker to select ('voice'); send 'default'")
    for name in ("ref_audio", "ref_text"):
        if name in body:
            raise _bad(name, f"the music model does not support reference-audio conditioning ('{name}')")
    if "language" in body:
        raise _bad("language", "the music model has no language tag ('language'); the language follows the lyrics")
    if "task_type" in body:
        raise _bad("task_type", "the music model does not support 'task_type'")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
        raise _bad(
            "speed", "the music model only supports speed=1.0; put the tempo in 'instructions', e.g. 'at 90 bpm'"
        )
    extra = body.get("extra_params") or {}
    if not isinstance(extra, dict):
        raise _bad("extra_params", "'extra_params' must be an object")
    for key in MANAGED_EXTRA_PARAMS:
        if key in extra:
            raise _bad(
                f"extra_params.{key}", f"extra_params.{key} is managed internally by the server and cannot be set"
            )
    if set(extra) - set(MANAGED_EXTRA_PARAMS):
        name = sorted(set(extra))[0]
        raise _bad(f"extra_params.{name}", f"unknown extra_params.{name}")
    if body.get("response_format", "wav") != "wav":
        raise _bad("response_format", "'response_format' must be 'wav'")


def speech_request(body: object) -> GenerationRequest:
    """The one request type of a ``/v1/audio/speech`` body (``seed`` defaults to 0: the same body, the same
    song); 400 naming the field for what the model cannot honour. The model checks the rest."""
    if not isinstance(body, dict):
        raise _bad("body", "the request body must be a JSON object")
    _refuse_unsupported(body)
    instructions, lyrics = body.get("instructions"), body.get("input")
    if not isinstance(instructions, str) or not instructions.strip():
        raise _bad("instructions", "the music model requires 'instructions' describing the music")
    if not isinstance(lyrics, str) or not lyrics.strip():
        raise _bad("input", "the music model requires non-empty 'input' carrying the lyrics")
    return GenerationRequest(
        prompt=instructions, lyrics=lyrics, seed=body.get("seed", 0), max_new_tokens=body.get("max_new_tokens")
    )


def speech_router(state) -> APIRouter:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
    router = APIRouter()

    @router.post(
        "/v1/audio/speech",
        response_class=Response,
        responses={200: {"content": {"audio/wav": {}}, "description": "the song (WAV)"}},
    )
    async def speech(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise _bad("body", "the request body is not valid JSON") from None
        state.check_model(body.get("model") if isinstance(body, dict) else None)
        generation = speech_request(body)
        for name, value in (("instructions", generation.prompt), ("input", generation.lyrics)):
            state.check_text(name, value)
        state.check_task("text-to-music", "/v1/audio/speech")
        resolved = state.resolve(generation, SPEECH_PARAMS)
        result = await state.run(resolved, request, SPEECH_PARAMS)
        return Response(result.outputs[0], media_type="audio/wav")

    return router
