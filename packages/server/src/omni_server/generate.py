"""``omni-server generate``: one prompt to PNG files in this process, with a progress bar over denoising steps."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from omni_server.config import ConfigError, ServerConfig


class GenerateError(Exception):
    """A bad request or setting; the message names the field and what to change."""


class ProgressBar:
    """A dependency-free text progress bar, redrawn in place on a terminal stream."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self._total, self._stream, self._width = max(total, 1), stream, width
        self._start = time.monotonic()
        self._done = 0

    def advance(self) -> None:
        self._done = min(self._done + 1, self._total)
        filled = self._width * self._done // self._total
        elapsed = time.monotonic() - self._start
        self._stream.write(
            f"\rdenoising |{'#' * filled}{'.' * (self._width - filled)}| {self._done}/{self._total} "
            f"[{elapsed:.1f}s]"
        )
        if self._done == self._total:
            self._stream.write("\n")
        self._stream.flush()


def output_paths(output: Path, n: int) -> list[Path]:
    """``out.png`` for one image; ``out-0.png`` ... ``out-{n-1}.png`` for several."""
    if n == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i}{output.suffix or '.png'}") for i in range(n)]


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WIDTHxHEIGHT"`` -> ``(height, width)``."""
    if size is None:
        return None, None
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise GenerateError(f"--size must look like WIDTHxHEIGHT, e.g. 32x32; got {size!r}")
    return int(parts[1]), int(parts[0])


def generate_to_files(
    config: ServerConfig,
    *,
    prompt: str,
    output: Path,
    n: int = 1,
    negative_prompt: str | None = None,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    true_cfg_scale: float | None = None,
    size: str | None = None,
    seed: int | None = None,
    progress_stream: TextIO = sys.stderr,
) -> list[Path]:
    """Load the model as ``serve`` would, generate ``n`` images and write them as PNG.

    Image ``i`` is seeded ``seed + i``; a real family maps the request's fields as the server's engine does
    (``family_engine.family_request_kwargs``), so ``generate`` and ``serve`` draw the same images. With a world
    size above 1 this process is rank 0 of one process per GPU (``omni_server.workers``).
    """
    from omni_server.loader import load_pipeline

    if n < 1:
        raise GenerateError(f"-n must be >= 1; got {n}")
    height, width = parse_size(size)
    try:
        if config.world_size > 1:
            from omni_server.workers import WorkerGroup

            pipeline = WorkerGroup.start(config)  # this process is rank 0 of one process per GPU
        else:
            pipeline = load_pipeline(config)
    except ConfigError as exc:
        raise GenerateError(str(exc)) from None
    try:
        return _generate(pipeline, prompt=prompt, output=output, n=n, negative_prompt=negative_prompt,
                         num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                         true_cfg_scale=true_cfg_scale, height=height, width=width, seed=seed,
                         progress_stream=progress_stream)
    finally:
        close = getattr(pipeline, "close", None)
        if close is not None:
            close()


def _generate(pipeline: Any, *, prompt: str, output: Path, n: int, negative_prompt: str | None,
              num_inference_steps: int | None, guidance_scale: float | None, true_cfg_scale: float | None,
              height: int | None, width: int | None, seed: int | None, progress_stream: TextIO) -> list[Path]:
    from omni_models import FamilyPipeline, InvalidRequestError

    from omni_server.family_engine import family_request_kwargs
    from omni_server.protocol import GenerationParams

    steps = num_inference_steps if num_inference_steps is not None else pipeline.info.default_steps
    bar = ProgressBar(int(steps), progress_stream)

    def on_step_end(*_args: Any, **_kwargs: Any) -> None:
        bar.advance()

    try:
        # A multi-rank pipeline (omni_server.workers.DistributedPipeline) wraps rank 0's own pipeline.
        if isinstance(getattr(pipeline, "local", pipeline), FamilyPipeline):
            params = GenerationParams(prompt=prompt, negative_prompt=negative_prompt, n=n, height=height, width=width,
                                      num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                      true_cfg_scale=true_cfg_scale, seed=seed)
            kwargs = family_request_kwargs(pipeline.info, params)
            images = pipeline(kwargs.pop("prompt"), **kwargs, seed=seed, num_images_per_prompt=n,
                              callback_on_step_end=on_step_end)
        elif true_cfg_scale is not None:
            raise GenerateError("--true-cfg-scale applies to the real families (FLUX.1, Qwen-Image); omni models take "
                                "--guidance-scale")
        else:
            images = pipeline(
                [prompt] * n if n > 1 else prompt,
                negative_prompt=[negative_prompt] * n if (negative_prompt is not None and n > 1) else negative_prompt,
                num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed,
                height=height, width=width, callback_on_step_end=on_step_end,
            )
    except InvalidRequestError as exc:
        raise GenerateError(f"{exc.param}: {exc}") from None
    paths = output_paths(output, n)
    for path, image in zip(paths, images, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, format="PNG")
    return paths
