"""The one request type every entry point builds, and the one place it is checked against a model.

``GenerationRequest`` is what the HTTP routes, the CLI and the pipelines' one-call APIs build from their inputs
(a field left unset takes the model's default). ``resolve_request(info, request)`` checks it once against the
model's ``ModelInfo`` and the limits table (``omni_models.limits``), fills every default, draws the seed of a
request that names none, and returns a ``ResolvedRequest``, which the pipelines' ``prepare`` take as it is. A
field the model does not use is refused by name, never ignored.

What the fields mean, for every model kind:
- ``guidance_scale`` is the model's guidance: classifier-free guidance of the shipped DiT, FLUX.1-dev's embedded
  guidance, the true-CFG scale of Qwen-Image and FLUX.1-schnell. Each pipeline maps it onto its mechanism.
- ``true_cfg_scale`` names true CFG explicitly where it stacks on another guidance (FLUX.1-dev); for a model
  whose guidance *is* true CFG it must agree with ``guidance_scale`` when both are given.
- ``negative_prompt``: unset means the model's default negative prompt; ``None`` means none.
- image ``i`` of a request uses seed ``seed + i``.
- ``images`` (``image`` in ``ModelInfo.accepts``): the input images of an edit (``omni_models.input_images``), at
  most ``ImageLimits.max_input_images``; with images and no size, the output takes the first image's size rounded to
  the model's granularity (``ImageLimits.fit_size``).
- music: ``prompt`` is the caption, ``lyrics`` the structure-tagged lyrics, ``max_new_tokens`` a cap on frames.
- ``cache``: the request's step cache (``omni_models.step_cache``): a preset name (``"off"``, ``"safe"``,
  ``"fast"``) or an object of knobs; unset: the caller's default (the server's ``--step-cache``). Resolved to a
  ``StepCacheConfig``, or None when off.
- video (``ModelInfo.video``): ``num_frames`` (``frame_multiple * k + 1``), ``fps`` (the output's frame rate: a
  label, the frames drawn do not depend on it) and, for a model of two experts (Wan2.2 A14B), ``guidance_scale_2``:
  the low-noise expert's guidance; unset, it takes ``guidance_scale`` when the request gives one (diffusers' rule),
  else the model's default. An image or music model refuses them by name; the resolved values are 0 / None there.
- ``lora`` names a LoRA adapter the pipeline serves (a server maps ``model: "<adapter name>"`` onto it);
  ``lora_scale`` (default 1) multiplies its delta, as diffusers' ``set_adapters([name], [scale])``. Which adapters
  exist is the pipeline's state, checked by its ``prepare``; the scale is checked here.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec

from omni_models.errors import InvalidRequestError
from omni_models.input_images import InputImage
from omni_models.limits import MAX_GUIDANCE_SCALE, MAX_LORA_SCALE, MAX_SEED, draw_seed
from omni_models.spec import ModelInfo
from omni_models.step_cache import OFF, StepCacheConfig, parse_step_cache


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request as its entry point received it; ``None`` (and ``UNSET`` for the negative prompt) means the
    model's default."""

    prompt: str
    negative_prompt: str | None | msgspec.UnsetType = msgspec.UNSET
    n: int = 1
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    lyrics: str | None = None
    max_new_tokens: int | None = None
    images: tuple[InputImage, ...] = ()
    cache: str | dict[str, Any] | None = None
    lora: str | None = None
    lora_scale: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale_2: float | None = None


class ResolvedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request checked against one model: every field concrete. ``height``/``width``/``num_inference_steps``/
    ``guidance_scale`` are 0 for a music model; ``lyrics``/``max_new_tokens`` None for an image model."""

    prompt: str
    negative_prompt: str | None
    n: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float | None
    seed: int
    lyrics: str | None = None
    max_new_tokens: int | None = None
    images: tuple[InputImage, ...] = ()
    cache: StepCacheConfig | None = None  # None: no step cache
    lora: str | None = None
    lora_scale: float = 1.0
    num_frames: int = 0  # 0: not a video model
    fps: int = 0
    guidance_scale_2: float | None = None  # a two-expert video model's low-noise guidance


# The request fields ``ModelInfo.accepts`` names, and the attribute each is set through (``size``: two).
_FIELD_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "negative_prompt": ("negative_prompt",),
    "n": ("n",),
    "size": ("height", "width"),
    "num_inference_steps": ("num_inference_steps",),
    "guidance_scale": ("guidance_scale",),
    "true_cfg_scale": ("true_cfg_scale",),
    "lyrics": ("lyrics",),
    "max_new_tokens": ("max_new_tokens",),
    "image": ("images",),
    "cache": ("cache",),
    "lora": ("lora",),
    "num_frames": ("num_frames",),
    "fps": ("fps",),
    "guidance_scale_2": ("guidance_scale_2",),
}
_UNSET_VALUES: dict[str, Any] = {"negative_prompt": msgspec.UNSET, "n": 1, "image": ()}


def _given(request: GenerationRequest, field: str) -> bool:
    unset = _UNSET_VALUES.get(field)
    return any(getattr(request, attribute) != unset for attribute in _FIELD_ATTRIBUTES[field])


def _integer(value: Any, param: str, low: int, high: int, what: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{what or param} must be an integer in [{low}, {high}], got {value!r}", param=param)
    return value


def _scale(value: Any, param: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0.0 <= value <= MAX_GUIDANCE_SCALE
    ):
        raise InvalidRequestError(
            f"{param} must be a finite number in [0, {MAX_GUIDANCE_SCALE:g}], got {value!r}", param=param
        )
    return float(value)


def _text(value: Any, param: str, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        expected = "a non-empty string" if required else "a string or None"
        raise InvalidRequestError(f"{param} must be {expected}, got {value!r}", param=param)
    return value


def _seed(value: Any, n: int, max_seed: int, rng: random.Random | None) -> int:
    if value is None:
        return draw_seed(rng)
    top = max_seed - (n - 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        detail = f" (image i of a request uses seed + i, so with n={n} it must be at most {top})" if n > 1 else ""
        raise InvalidRequestError(f"seed must be an integer in [0, {top}]{detail}, got {value!r}", param="seed")
    return value


def resolve_request(
    info: ModelInfo,
    request: GenerationRequest,
    *,
    rng: random.Random | None = None,
    default_cache: StepCacheConfig = OFF,
) -> ResolvedRequest:
    """Check ``request`` against ``info`` and the limits table; fill every default; draw the seed if unset.

    Raises ``InvalidRequestError`` whose ``param`` names the field (``size`` for height and width) and changes
    nothing. ``rng``: the stream a request without a seed draws from (default: system entropy);
    ``default_cache``: the step cache of a request that names none (the server's ``--step-cache``).
    """
    for field in _FIELD_ATTRIBUTES:
        if field not in info.accepts and _given(request, field):
            raise InvalidRequestError(
                f"{info.variant} does not use {field}; it accepts {', '.join(info.accepts)}",
                param="model" if field == "lora" else field,  # an adapter is named by the request's model
            )
    prompt = _text(request.prompt, "prompt", required=True)
    lora, lora_scale = _lora(request)
    if info.audio is not None:
        return _resolve_music(info, request, prompt, rng)
    limits = info.image
    assert limits is not None  # ModelInfo holds the limits of its task
    n = _integer(request.n, "n", 1, limits.max_images_per_request)
    images = tuple(request.images)
    if len(images) > limits.max_input_images:
        raise InvalidRequestError(
            f"got {len(images)} input images; {info.variant} takes at most {limits.max_input_images}", param="image"
        )
    if len(images) < limits.min_input_images:
        raise InvalidRequestError(
            f"{info.variant} edits images: image is required (at least {limits.min_input_images} input image; "
            "send it to /v1/images/edits)",
            param="image",
        )
    if not all(isinstance(image, InputImage) for image in images):
        raise InvalidRequestError("images must be InputImage values (omni_models.decode_input_image)", param="image")
    default_height, default_width = limits.default_size
    if images and request.height is None and request.width is None:
        default_height, default_width = limits.fit_size(images[0].height, images[0].width)
    height = default_height if request.height is None else request.height
    width = default_width if request.width is None else request.width
    for side, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(f"{side} must be an integer, got {value!r}", param="size")
    problem = limits.size_problem(height, width, info.variant)
    if problem is not None:
        raise InvalidRequestError(problem, param="size")
    steps = limits.default_steps if request.num_inference_steps is None else request.num_inference_steps
    steps = _integer(steps, "num_inference_steps", 1, limits.max_inference_steps)
    negative = request.negative_prompt
    negative = (
        limits.default_negative_prompt
        if negative is msgspec.UNSET
        else _text(negative, "negative_prompt", required=False)
    )
    guidance, true_cfg = _guidance(info, request)
    num_frames, fps, guidance_2 = _video(info, request, guidance)
    cache = None
    if "cache" in info.accepts:
        cache = parse_step_cache(
            request.cache, num_blocks=info.transformer_blocks, num_steps=steps, default=default_cache
        )
    return ResolvedRequest(
        prompt=prompt,
        negative_prompt=negative,
        n=n,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        true_cfg_scale=true_cfg,
        seed=_seed(request.seed, n, MAX_SEED, rng),
        images=images,
        cache=cache if cache is not None and cache.enabled else None,
        lora=lora,
        lora_scale=lora_scale,
        num_frames=num_frames,
        fps=fps,
        guidance_scale_2=guidance_2,
    )


def _video(info: ModelInfo, request: GenerationRequest, guidance: float) -> tuple[int, int, float | None]:
    """(num_frames, fps, guidance_scale_2) of a video model; (0, 0, None) for an image model."""
    limits = info.video
    if limits is None:
        return 0, 0, None
    frames = limits.default_num_frames if request.num_frames is None else request.num_frames
    if isinstance(frames, bool) or not isinstance(frames, int):
        raise InvalidRequestError(f"num_frames must be an integer, got {frames!r}", param="num_frames")
    problem = limits.num_frames_problem(frames)
    if problem is not None:
        raise InvalidRequestError(problem, param="num_frames")
    fps = _integer(limits.default_fps if request.fps is None else request.fps, "fps", 1, limits.max_fps)
    if limits.experts < 2:
        return frames, fps, None
    if request.guidance_scale_2 is not None:
        return frames, fps, _scale(request.guidance_scale_2, "guidance_scale_2")
    if request.guidance_scale is not None or limits.default_guidance_scale_2 is None:
        return frames, fps, guidance
    return frames, fps, limits.default_guidance_scale_2


def _lora(request: GenerationRequest) -> tuple[str | None, float]:
    """(adapter name, scale): a scale needs an adapter; the scale is finite, within +-``MAX_LORA_SCALE``."""
    name, scale = request.lora, request.lora_scale
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidRequestError(f"lora must name a LoRA adapter, got {name!r}", param="model")
    if scale is None:
        return name, 1.0
    if name is None:
        raise InvalidRequestError(
            "lora_scale applies to a LoRA adapter; select one with model=<adapter name>", param="lora_scale"
        )
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or abs(scale) > MAX_LORA_SCALE
    ):
        raise InvalidRequestError(
            f"lora_scale must be a finite number in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got {scale!r}",
            param="lora_scale",
        )
    return name, float(scale)


def _guidance(info: ModelInfo, request: GenerationRequest) -> tuple[float, float | None]:
    """(guidance_scale, true_cfg_scale) as the model's guidance kind reads them."""
    limits = info.image
    assert limits is not None
    given = None if request.guidance_scale is None else _scale(request.guidance_scale, "guidance_scale")
    true_cfg = None if request.true_cfg_scale is None else _scale(request.true_cfg_scale, "true_cfg_scale")
    if limits.guidance == "true-cfg":
        if given is not None and true_cfg is not None and given != true_cfg:
            raise InvalidRequestError(
                f"{info.variant} has no embedded guidance, so guidance_scale is its true-CFG scale; got "
                f"guidance_scale={given:g} and true_cfg_scale={true_cfg:g}: give one of them",
                param="guidance_scale",
            )
        scale = next((v for v in (given, true_cfg) if v is not None), limits.default_guidance_scale)
        return scale, scale
    guidance = limits.default_guidance_scale if given is None else given
    if limits.true_cfg:
        return guidance, limits.default_true_cfg_scale if true_cfg is None else true_cfg
    return guidance, None


def _resolve_music(
    info: ModelInfo, request: GenerationRequest, caption: str, rng: random.Random | None
) -> ResolvedRequest:
    limits = info.audio
    assert limits is not None
    lyrics = _text(request.lyrics, "lyrics", required=True)
    frames = limits.max_frames if request.max_new_tokens is None else request.max_new_tokens
    frames = _integer(
        frames,
        "max_new_tokens",
        1,
        limits.max_frames,
        f"max_new_tokens (audio frames at {limits.frame_rate} per second)",
    )
    return ResolvedRequest(
        prompt=caption,
        negative_prompt=None,
        n=1,
        height=0,
        width=0,
        num_inference_steps=0,
        guidance_scale=0.0,
        true_cfg_scale=None,
        seed=_seed(request.seed, 1, limits.max_seed, rng),
        lyrics=lyrics,
        max_new_tokens=frames,
    )


def prepare_one_call(pipeline: Any, prompt: Any, negative_prompt: Any, seed: int | None, **fields: Any) -> list[Any]:
    """The jobs of a pipeline's one-call API (``pipe(prompt or prompts, ...)``): one request per prompt, each
    checked before any model work, the seeds consecutive across prompts (prompt ``j`` starts after prompt
    ``j - 1``'s images), the first drawn when ``seed`` is None. ``negative_prompt`` None means none."""
    from omni_models.limits import check_prompt_batch

    prompts, negatives = check_prompt_batch(prompt, negative_prompt)
    jobs: list[Any] = []
    for text, negative in zip(prompts, negatives, strict=True):
        first = seed if not jobs else jobs[0].request.seed + len(jobs)
        request = GenerationRequest(prompt=text, negative_prompt=negative, seed=first, **fields)
        jobs.extend(pipeline.prepare(resolve_request(pipeline.info, request)))
    return jobs


__all__ = ["GenerationRequest", "ResolvedRequest", "prepare_one_call", "resolve_request"]
