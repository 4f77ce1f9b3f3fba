"""Text-to-music serving: ``POST /v1/audio/speech`` (Music-3-style contract, scaled to the model), the audio
playground page, and the CLI's song generation. Used when the served model is a music model
(``omni_models.music``); the image routes and engine are not started then.

The music pipeline runs in this process (its AR stage is vLLM's engine, in-process); requests are serialized by
the pipeline. HTTP and CLI build the same ``MusicRequest`` and so give the same WAV bytes for the same seed.
"""

from __future__ import annotations

import asyncio
import html
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from omni_server.api import APIError, _error_response
from omni_server.config import ServerConfig

logger = logging.getLogger("omni_server.audio")

# Sampling is fixed by the model (guidance, top-k, seeded draws): these are refused, never ignored.
REFUSED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")
MANAGED_EXTRA_PARAMS = ("cfg_role", "cfg_pair_id", "cfg_null_prompt")
KNOWN_FIELDS = frozenset({"model", "input", "instructions", "seed", "max_new_tokens", "response_format", "stream",
                          "voice", "speed", *REFUSED_SAMPLING_FIELDS, "ref_audio", "ref_text", "language",
                          "task_type", "extra_params"})


def is_music_model(name: str) -> bool:
    """Whether ``name`` (a shipped model name or a directory) is a music model."""
    from omni_models.music.pipeline import load_music  # noqa: F401 - confirms the family is importable

    directory = Path(name)
    if not (directory / "ar.safetensors").exists():
        import omni_models

        directory = Path(omni_models.__file__).parent / "weights" / name
    return (directory / "ar.safetensors").exists() and (directory / "acoustic.safetensors").exists()


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code="invalid_value")


def parse_speech_request(body: Any, max_frames: int, frame_rate: int) -> dict[str, Any]:
    """The validated ``MusicRequest`` fields of a ``/v1/audio/speech`` body; APIError(400) naming the field."""
    if not isinstance(body, dict):
        raise _bad("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unknown field '{unknown[0]}'; the music model accepts input, instructions, seed, "
                               "max_new_tokens and response_format")
    if body.get("stream"):
        raise _bad("stream", "'stream' is not supported: the music model answers with one WAV file")
    for name in REFUSED_SAMPLING_FIELDS:
        if name in body:
            raise _bad(name, f"the music model has fixed sampling and does not accept: '{name}'")
    if body.get("voice") not in (None, "", "default"):
        raise _bad("voice", "the music model has no speaker to select ('voice')")
    for name in ("ref_audio", "ref_text"):
        if name in body:
            raise _bad(name, f"the music model does not support reference-audio conditioning ('{name}')")
    if "language" in body:
        raise _bad("language", "the music model has no language tag ('language'); the language follows the lyrics")
    if "task_type" in body:
        raise _bad("task_type", "the music model does not support 'task_type'")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
        raise _bad("speed", "the music model only supports speed=1.0; put the tempo in 'instructions', "
                            "e.g. 'at 90 bpm'")
    extra = body.get("extra_params") or {}
    if not isinstance(extra, dict):
        raise _bad("extra_params", "'extra_params' must be an object")
    for key in MANAGED_EXTRA_PARAMS:
        if key in extra:
            raise _bad(f"extra_params.{key}", f"extra_params.{key} is managed internally by the server and cannot "
                                              "be set")
    if set(extra) - set(MANAGED_EXTRA_PARAMS):
        name = sorted(set(extra))[0]
        raise _bad(f"extra_params.{name}", f"unknown extra_params.{name}")
    instructions, lyrics = body.get("instructions"), body.get("input")
    if not isinstance(instructions, str) or not instructions.strip():
        raise _bad("instructions", "the music model requires 'instructions' describing the music")
    if not isinstance(lyrics, str) or not lyrics.strip():
        raise _bad("input", "the music model requires non-empty 'input' carrying the lyrics")
    seed = body.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _bad("seed", f"'seed' must be a non-negative integer, got {seed!r}")
    frames = body.get("max_new_tokens", max_frames)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise _bad("max_new_tokens", "'max_new_tokens' must be at least 1")
    if frames > max_frames:
        raise _bad("max_new_tokens", f"'max_new_tokens' counts audio frames at {frame_rate} per second and cannot "
                                     f"exceed {max_frames}")
    if body.get("response_format", "wav") != "wav":
        raise _bad("response_format", "'response_format' must be 'wav'")
    return {"lyrics": lyrics, "caption": instructions, "seed": seed, "max_frames": frames}


def create_audio_app(config: ServerConfig) -> FastAPI:
    """The app for a music model: /health, /v1/models, /v1/audio/speech and the audio playground."""
    from omni_models.errors import InvalidRequestError
    from omni_models.music import MusicRequest, load_music

    pipeline = load_music(config.model)
    music = pipeline.config
    app = FastAPI(title="omni-server (music)")

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, config.max_error_message_chars)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "owned_by": "omni", "task": "text-to-music",
            "sample_rate": music.sample_rate, "channels": music.channels, "frame_rate": music.frame_rate,
            "max_new_tokens": music.max_frames}]})

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise _bad("body", "the request body is not valid JSON") from None
        if body.get("model") not in (None, config.model_name) if isinstance(body, dict) else False:
            raise APIError(404, f"model {body['model']!r} does not exist; this server serves {config.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        fields = parse_speech_request(body, music.max_frames, music.frame_rate)
        try:
            songs = await asyncio.to_thread(pipeline.generate, [MusicRequest(**fields)])
        except InvalidRequestError as exc:
            raise _bad(exc.param or "input", str(exc)) from None
        return Response(songs[0].wav(), media_type="audio/wav")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        page = resources.files("omni_server").joinpath("audio_playground.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(config.model_name)))

    return app


def generate_song_file(config: ServerConfig, *, caption: str, lyrics: str, seed: int, max_new_tokens: int | None,
                       output: Path) -> Path:
    """The CLI path: the same validation and pipeline as the HTTP route; writes the WAV to ``output``."""
    from omni_models.errors import InvalidRequestError
    from omni_models.music import MusicRequest, load_music

    pipeline = load_music(config.model)
    body: dict[str, Any] = {"input": lyrics, "instructions": caption, "seed": seed}
    if max_new_tokens is not None:
        body["max_new_tokens"] = max_new_tokens
    fields = parse_speech_request(body, pipeline.config.max_frames, pipeline.config.frame_rate)
    try:
        song = pipeline.generate([MusicRequest(**fields)])[0]
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), type="invalid_request_error", param=exc.param) from None
    output.write_bytes(song.wav())
    return output


def generate_song(args: Any, config: ServerConfig) -> int:
    """``omni-server generate --lyrics ... CAPTION -o song.wav``: exit status 0, or 2 with the error on stderr."""
    import sys

    output = Path(args.output if args.output != "out.png" else "song.wav")
    seed = args.image_seed if args.image_seed is not None else config.seed
    try:
        if not is_music_model(config.model):
            raise APIError(400, f"--lyrics needs a music model; {config.model!r} is not one", type="invalid_request_error",
                           param="model")
        generate_song_file(config, caption=args.prompt, lyrics=args.lyrics.replace("\\n", "\n"), seed=seed,
                           max_new_tokens=args.max_new_tokens, output=output)
    except APIError as exc:
        print(f"omni-server: error: {exc.message}", file=sys.stderr)
        return 2
    print(output)
    return 0
