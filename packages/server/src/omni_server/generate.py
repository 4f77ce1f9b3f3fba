"""``omni-server generate``: one request through the same engine core as ``serve``, in this process.

The request is built from the flags and checked against the model's metadata (``omni_models.inspect``) before
anything loads (``--lora PATH[:SCALE]`` serves that one adapter, checked at start like ``serve``'s
``--lora-modules``); then the engine (``omni_server.engine.EngineCore``, the one ``serve`` runs, over one rank or a
worker group) runs it with a progress bar over its steps, and its outputs are written: PNG per image (``-n``:
``NAME-i.png``), WAV for a song, MP4 for a video (``omni_server.video_io``, ``--video-crf``). The same seed gives
the same bytes as the HTTP API.
"""

from __future__ import annotations

import io
import re
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import TextIO

import msgspec

from omni_models import (
    GenerationRequest,
    InputImage,
    InvalidRequestError,
    ModelInfo,
    ModelSpec,
    PromptReader,
    ResolvedRequest,
    decode_input_image,
    resolve_request,
)
from omni_server.config import ConfigError, ServerConfig

# The flag a request field comes from, for messages.
REQUEST_FLAGS = {
    "prompt": "PROMPT",
    "negative_prompt": "--negative-prompt",
    "size": "--size",
    "num_inference_steps": "--steps",
    "guidance_scale": "--guidance-scale",
    "true_cfg_scale": "--true-cfg-scale",
    "n": "-n",
    "seed": "--image-seed",
    "lyrics": "--lyrics",
    "max_new_tokens": "--max-new-tokens",
    "image": "--image",
    "cache": "--step-cache",
    "model": "--lora",
    "lora_scale": "--lora",
    "num_frames": "--num-frames",
    "fps": "--fps",
    "guidance_scale_2": "--guidance-scale-2",
}
SMALL_SIDE = 128  # below this, generate says how to write the image larger


class GenerateError(Exception):
    """A bad request or setting; the message names the flag and what to change."""


class ProgressBar:
    """A dependency-free text progress bar, redrawn in place on a terminal stream."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30, label: str = "denoising") -> None:
        self._total, self._stream, self._width, self._label = max(total, 1), stream, width, label
        self._start = time.monotonic()
        self._done = 0

    def update(self, done: int) -> None:
        done = min(max(done, self._done), self._total)
        if done == self._done:
            return
        self._done = done
        filled = self._width * done // self._total
        elapsed = time.monotonic() - self._start
        self._stream.write(
            f"\r{self._label} |{'#' * filled}{'.' * (self._width - filled)}| {done}/{self._total} [{elapsed:.1f}s]"
        )
        if done == self._total:
            self._stream.write("\n")
        self._stream.flush()


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WIDTHxHEIGHT"`` -> ``(height, width)``; the model checks the values."""
    if size is None:
        return None, None
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", size)
    if match is None:
        raise GenerateError(f"--size must look like WIDTHxHEIGHT, e.g. 32x32; got {size!r}")
    width, height = (int(part) for part in match.groups())
    return height, width


def parse_lora_argument(value: str) -> tuple[str, float | None]:
    """``PATH[:SCALE]`` -> (path, scale or None); a tail that is not a number belongs to the path."""
    path, sep, tail = value.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    if not value:
        raise ConfigError("--lora takes PATH[:SCALE], e.g. style.safetensors:0.8")
    return value, None


def with_lora(config: ServerConfig, value: str) -> ServerConfig:
    """``config`` serving the one adapter of ``--lora PATH[:SCALE]`` (named by its file), for ``generate``."""
    from omni_server.config import LoRAModule

    path, _ = parse_lora_argument(value)
    name = Path(path).stem or "lora"
    if name == config.model_name:
        name += "-lora"
    return msgspec.structs.replace(
        config, enable_lora=True, max_loras=1, lora_modules=[LoRAModule(name=name, path=path)]
    )


def request_from_args(args: Namespace, info: ModelInfo, config: ServerConfig) -> ResolvedRequest:
    """The flags' request, checked against the model (before it loads); ``GenerateError`` naming the flag."""
    height, width = parse_size(args.size)
    images = tuple(read_input_image(path, config) for path in getattr(args, "images", ()))
    lyrics = None if args.lyrics is None else args.lyrics.replace("\\n", "\n")
    request = GenerationRequest(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        n=args.n,
        height=height,
        width=width,
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale,
        seed=args.image_seed if args.image_seed is not None else config.seed,
        lyrics=lyrics,
        max_new_tokens=args.max_new_tokens,
        images=images,
        lora=config.lora_modules[0].name if getattr(args, "lora", None) else None,
        lora_scale=parse_lora_argument(args.lora)[1] if getattr(args, "lora", None) else None,
        num_frames=getattr(args, "num_frames", None),
        fps=getattr(args, "fps", None),
        guidance_scale_2=getattr(args, "guidance_scale_2", None),
    )
    try:
        resolved = resolve_request(info, request, default_cache=config.default_step_cache())
        if info.vocabulary:  # a closed vocabulary: its words are checked here too, not after a load
            PromptReader.from_info(info).rows(resolved)
    except InvalidRequestError as exc:
        raise GenerateError(f"{REQUEST_FLAGS.get(exc.param, exc.param)}: {exc}") from None
    return resolved


def read_input_image(path: str, config: ServerConfig) -> InputImage:
    """One ``--image`` file, decoded and checked as the edits route checks an upload; ``GenerateError`` naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GenerateError(f"--image {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return decode_input_image(
            data, max_bytes=config.max_input_image_bytes, max_pixels=config.max_input_image_pixels, param="--image"
        )
    except InvalidRequestError as exc:
        raise GenerateError(f"--image {path}: {exc}") from None


def output_paths(output: Path, n: int) -> list[Path]:
    """``out.png`` for one output; ``out-0.png`` ... ``out-{n-1}.png`` for several."""
    if n == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i}{output.suffix or '.png'}") for i in range(n)]


def _upscaled(png: bytes, factor: int) -> bytes:
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    buffer = io.BytesIO()
    image.resize((image.width * factor, image.height * factor), Image.Resampling.NEAREST).save(buffer, format="PNG")
    return buffer.getvalue()


def generate_to_files(
    config: ServerConfig,
    spec: ModelSpec,
    request: ResolvedRequest,
    *,
    output: str | None = None,
    upscale: int = 1,
    progress_stream: TextIO = sys.stderr,
) -> list[Path]:
    """Run ``request`` through the engine core on the configured model and write its outputs; returns the paths."""
    from omni_server.engine import EngineCore, load_pipeline
    from omni_server.protocol import EngineStats, RequestFinished

    music = spec.info.audio is not None
    video = spec.info.task == "text-to-video"
    if upscale < 1 or (upscale > 1 and (music or video)):
        raise GenerateError(
            "--upscale takes a whole factor >= 1, for images"
            if upscale < 1
            else f"--upscale applies to images; a {'music' if music else 'video'} model writes "
            f"{'a WAV' if music else 'an MP4'}"
        )
    if video:
        from omni_server import video_io

        if not video_io.available():
            raise GenerateError(video_io.MISSING_AV)
    path = Path(output or ("song.wav" if music else "clip.mp4" if video else "out.png"))
    try:
        if config.world_size > 1:
            from omni_server.workers import WorkerGroup

            pipeline = WorkerGroup.start(config)  # this process is rank 0 of one process per GPU
        else:
            pipeline = load_pipeline(config)
    except ConfigError as exc:
        raise GenerateError(str(exc)) from None
    engine = EngineCore(pipeline, msgspec.structs.replace(config, warmup=False))
    try:
        engine.add("generate", request)
        total = request.max_new_tokens + 1 if music else request.num_inference_steps
        bar = ProgressBar(total, progress_stream, label="generating" if music else "denoising")
        finished = None
        while finished is None:
            for message in engine.step():
                if isinstance(message, EngineStats):
                    for item in message.progress:
                        bar.update(item.step)
                elif isinstance(message, RequestFinished):
                    finished = message
    finally:
        engine.close()
    if finished.error is not None:
        param = finished.error.param
        where = f"{REQUEST_FLAGS.get(param, param)}: " if param else ""
        raise GenerateError(f"{where}{finished.error.message}")
    bar.update(total)
    paths = output_paths(path, len(finished.outputs))
    for file, data in zip(paths, finished.outputs, strict=True):
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(_upscaled(data, upscale) if upscale > 1 else data)
    if not music and not video and upscale == 1 and max(request.height, request.width) < SMALL_SIDE:
        print(
            f"note: {spec.info.variant} draws {request.width}x{request.height} images; --upscale 8 writes them "
            "8 times larger",
            file=progress_stream,
        )
    return paths
