"""HTTP request/response bodies (pydantic, so FastAPI publishes them in the OpenAPI schema).

The request schema is strict: unknown fields are rejected (a misspelt
``num_inference_step`` must not silently fall back to the default), numbers must
be finite, and ``size`` must look like ``WIDTHxHEIGHT``. Whether a size or step
count is supported by the loaded model is checked against its ``ModelCard``.
"""

from __future__ import annotations

from typing import Literal

from omni_models.limits import MAX_GUIDANCE_SCALE, MAX_INFERENCE_STEPS, MAX_SEED
from pydantic import BaseModel, ConfigDict, Field

from omni_server.protocol import ModelCard

MAX_IMAGES_PER_REQUEST = 10  # the server's limit (the engine's row pool is sized for it); the rest are the model's


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="Text describing the image.")
    model: str | None = Field(default=None, description="Served model name; defaults to the loaded model.")
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_REQUEST, description="Number of images.")
    size: str | None = Field(
        default=None, pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$", description="WIDTHxHEIGHT, e.g. 32x32."
    )
    response_format: Literal["b64_json"] = Field(
        default="b64_json", description="Only b64_json: images are returned inline as base64 PNG."
    )
    negative_prompt: str | None = Field(default=None, description="What the image should not show (CFG).")
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_INFERENCE_STEPS)
    guidance_scale: float | None = Field(
        default=None, ge=0.0, le=MAX_GUIDANCE_SCALE,
        description="The model's guidance: CFG for omni models, embedded guidance for FLUX.1-dev, the true-CFG scale "
                    "for families without embedded guidance (Qwen-Image, FLUX.1-schnell).")
    true_cfg_scale: float | None = Field(
        default=None, ge=0.0, le=MAX_GUIDANCE_SCALE,
        description="Real families only: classifier-free guidance with the negative prompt (applies when > 1).")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED,
                             description="Seed of image 0; image i uses seed + i, so seed + n - 1 must be <= 2**63 - 1.")
    user: str | None = Field(default=None, description="Accepted for OpenAI compatibility; unused.")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni"
    sizes: list[str]
    default_size: str
    default_num_inference_steps: int
    default_guidance_scale: float | None
    family: str = Field(description="omni-dit (the shipped model family), flux or qwen-image")
    variant: str | None = None
    size_range: dict[str, int] | None = Field(
        default=None, description="{multiple, min_side, max_side}: any WIDTHxHEIGHT within it (real families)")
    accepts: list[str] = Field(default_factory=list, description="request fields this model uses")
    default_true_cfg_scale: float | None = None
    default_negative_prompt: str | None = None
    max_images_per_request: int | None = None
    max_inference_steps: int | None = None
    max_prompt_tokens: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def model_object(card: ModelCard, created: int) -> ModelObject:
    """The /v1/models entry of a loaded model."""
    size_range = card.size_range
    return ModelObject(
        id=card.name, created=created, sizes=[f"{w}x{h}" for h, w in card.sizes],
        default_size=f"{card.default_size[1]}x{card.default_size[0]}",
        default_num_inference_steps=card.default_steps, default_guidance_scale=card.default_guidance_scale,
        family=card.family, variant=card.variant,
        size_range=None if size_range is None else {"multiple": size_range.multiple, "min_side": size_range.min_side,
                                                    "max_side": size_range.max_side},
        accepts=list(card.accepts), default_true_cfg_scale=card.default_true_cfg_scale,
        default_negative_prompt=card.default_negative_prompt, max_images_per_request=card.max_images_per_request,
        max_inference_steps=card.max_inference_steps, max_prompt_tokens=card.max_prompt_tokens,
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
