"""HTTP request/response bodies (pydantic, so FastAPI publishes them in the OpenAPI schema).

The request schemas are strict: unknown fields are rejected by name (a misspelt ``num_inference_step`` must not
silently fall back to the default), numbers must be finite, and ``size`` must look like ``WIDTHxHEIGHT``. Values
the OpenAI API defines whose meaning is what the server does anyway are accepted (``stream: false``,
``quality: "auto"``, ``background: "auto"``/``"opaque"``, ``moderation``, ``null`` for an optional field, ...);
values it cannot honour are a 400 naming the field. Whether a size or step count suits the loaded model is
checked once, against its ``ModelInfo`` (``omni_models.resolve_request``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_models import ModelInfo
from omni_models.limits import MAX_GUIDANCE_SCALE, MAX_IMAGES_PER_REQUEST, MAX_INFERENCE_STEPS, MAX_SEED
from omni_models.step_cache import preset_table

OutputFormat = Literal["png", "jpeg", "webp"]


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="Text describing the image.")
    model: str | None = Field(default=None, description="Served model name; defaults to the loaded model.")
    n: int | None = Field(default=None, ge=1, le=MAX_IMAGES_PER_REQUEST, description="Number of images (default 1).")
    size: str | None = Field(
        default=None,
        pattern=r"^(auto|[0-9]{1,5}x[0-9]{1,5})$",
        description="WIDTHxHEIGHT, e.g. 32x32; auto or omitted: the model's default.",
    )
    response_format: Literal["b64_json"] | None = Field(
        default=None, description="Only b64_json: images are returned inline, base64-encoded."
    )
    output_format: OutputFormat | None = Field(default=None, description="png (default), jpeg or webp.")
    output_compression: int | None = Field(
        default=None, ge=0, le=100, description="jpeg/webp quality in percent (default 100 for webp, 95 for jpeg)."
    )
    quality: Literal["auto"] | None = Field(default=None, description="Only auto: the model's own quality.")
    background: Literal["auto", "opaque"] | None = Field(default=None, description="Images are opaque RGB.")
    moderation: Literal["auto", "low"] | None = Field(default=None, description="Accepted; there is no moderation.")
    stream: Literal[False] | None = Field(default=None, description="Only false: one response with every image.")
    partial_images: Literal[0] | None = Field(default=None, description="Only 0 (no streaming).")
    negative_prompt: str | None = Field(
        default=None, description="What the image should not show (CFG); null: none; omitted: the model's default."
    )
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_INFERENCE_STEPS)
    guidance_scale: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_GUIDANCE_SCALE,
        description="The model's guidance: CFG for omni models, embedded guidance for FLUX.1-dev, the true-CFG scale "
        "for families without embedded guidance (Qwen-Image, FLUX.1-schnell).",
    )
    true_cfg_scale: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_GUIDANCE_SCALE,
        description="FLUX.1-dev: classifier-free guidance with the negative prompt on top of the embedded guidance.",
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SEED,
        description="Seed of image 0; image i uses seed + i, so seed + n - 1 must be <= 2**63 - 1.",
    )
    cache: str | dict[str, Any] | None = Field(
        default=None,
        description="Step cache (omni extension): a preset (off, safe, fast) or an object of knobs (see /v1/models "
        'step_cache_presets; {"preset": "fast", ...} overrides a preset\'s knobs); omitted: the server\'s '
        "--step-cache.",
    )
    lora_scale: float | None = Field(
        default=None,
        description="With model=<LoRA adapter name>: the adapter's weight (default 1.0), as diffusers' "
        "set_adapters([name], [scale]); checked by the model's request rules.",
    )
    user: str | None = Field(default=None, description="Accepted for OpenAI compatibility; unused.")
    safety_identifier: str | None = Field(default=None, description="Accepted for OpenAI compatibility; unused.")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class StepCacheUsage(BaseModel):
    """What one image's step cache did (omni extension of ``usage``)."""

    method: str
    num_steps: int
    computed_steps: int = Field(description="steps that ran the middle blocks")
    computed_fraction: float
    block_fraction: float = Field(description="repeated-block evaluations run over an uncached image's (FLOPs)")
    decisions: str = Field(description="one letter per step: C computed, S cached")
    residual_diffs: list[float | None] = Field(description="each step's relative change of the first blocks' residual")


class ImageUsage(BaseModel):
    step_cache: list[StepCacheUsage] | None = Field(default=None, description="one entry per image, in order")


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: OutputFormat | None = None
    size: str | None = None
    usage: ImageUsage | None = None


class ModelObject(BaseModel):
    """A ``/v1/models`` entry: OpenAI's fields, then what the model accepts (from its ``ModelInfo``). A LoRA adapter
    is listed as vLLM lists it: ``parent`` the base model, ``root`` its file."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni"
    parent: str | None = Field(default=None, description="LoRA adapters: the base model they apply to")
    root: str | None = Field(default=None, description="LoRA adapters: the adapter's file or directory")
    task: Literal["text-to-image", "text-to-video", "text-to-music"]
    family: str = Field(description="omni-dit, flux, flux-kontext, qwen-image, wan or omni-music")
    variant: str
    accepts: list[str] = Field(description="request fields this model uses")
    # image models
    sizes: list[str] | None = None
    default_size: str | None = None
    size_range: dict[str, int] | None = Field(
        default=None, description="{multiple, min_side, max_side}: any WIDTHxHEIGHT within it (real families)"
    )
    default_num_inference_steps: int | None = None
    default_guidance_scale: float | None = None
    default_true_cfg_scale: float | None = None
    default_negative_prompt: str | None = None
    max_images_per_request: int | None = None
    max_inference_steps: int | None = None
    max_prompt_tokens: int | None = None
    max_input_images: int | None = Field(default=None, description="edit models: input images per request")
    step_cache_presets: dict[str, dict[str, Any]] | None = Field(
        default=None, description="the `cache` presets and their knobs (models that accept `cache`)"
    )
    # video models (the image fields above describe each frame)
    default_num_frames: int | None = None
    max_num_frames: int | None = None
    frame_multiple: int | None = Field(default=None, description="video models: num_frames is frame_multiple * k + 1")
    default_fps: int | None = None
    max_fps: int | None = None
    # music models
    sample_rate: int | None = None
    channels: int | None = None
    frame_rate: int | None = None
    max_new_tokens: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def model_object(info: ModelInfo, served_name: str, created: int) -> ModelObject:
    """The ``/v1/models`` entry of a loaded model."""
    entry = ModelObject(
        id=served_name,
        created=created,
        task=info.task,
        family=info.family,
        variant=info.variant,
        accepts=list(info.accepts),
    )
    if info.image is not None:
        image = info.image
        rule = image.size_range
        entry = entry.model_copy(
            update=dict(
                sizes=[f"{w}x{h}" for h, w in image.sizes],
                default_size="{1}x{0}".format(*image.default_size),
                size_range=None
                if rule is None
                else {"multiple": rule.multiple, "min_side": rule.min_side, "max_side": rule.max_side},
                default_num_inference_steps=image.default_steps,
                default_guidance_scale=image.default_guidance_scale,
                default_true_cfg_scale=image.default_true_cfg_scale,
                default_negative_prompt=image.default_negative_prompt,
                max_images_per_request=image.max_images_per_request,
                max_inference_steps=image.max_inference_steps,
                max_prompt_tokens=image.max_prompt_tokens,
                max_input_images=image.max_input_images or None,
                step_cache_presets=preset_table() if "cache" in info.accepts else None,
            )
        )
    if info.video is not None:
        video = info.video
        entry = entry.model_copy(
            update=dict(
                default_num_frames=video.default_num_frames,
                max_num_frames=video.max_num_frames,
                frame_multiple=video.frame_multiple,
                default_fps=video.default_fps,
                max_fps=video.max_fps,
            )
        )
    if info.audio is not None:
        audio = info.audio
        entry = entry.model_copy(
            update=dict(
                sample_rate=audio.sample_rate,
                channels=audio.channels,
                frame_rate=audio.frame_rate,
                max_new_tokens=audio.max_frames,
            )
        )
    return entry


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, pattern=r"^[^\s=]+$", description="The name requests select it by.")
    lora_path: str = Field(min_length=1, description="A LoRA .safetensors file or a directory holding one.")


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
