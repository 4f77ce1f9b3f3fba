"""``POST /v1/images/generations``: the OpenAI images API over the one engine.

The body (``schemas.ImageGenerationRequest``) becomes the one request type and is checked once against the model
(``ServerState.resolve``); ``ServerState.run`` runs it; the images come back base64-encoded in the requested
``output_format`` (PNG from the engine, re-encoded here for jpeg/webp with ``output_compression``).
"""

from __future__ import annotations

import base64
import io
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_models import GenerationRequest
from omni_server.schemas import ImageData, ImageGenerationRequest, ImageGenerationResponse, ImageUsage, StepCacheUsage

# The quality each lossy format is written at when the request names none (percent).
DEFAULT_COMPRESSION = {"jpeg": 95, "webp": 100}


def encode_image(png: bytes, output_format: str, compression: int | None) -> bytes:
    """``png`` as the requested format (PNG unchanged; JPEG and WebP through Pillow at ``compression`` quality)."""
    if output_format == "png":
        return png
    from PIL import Image

    buffer = io.BytesIO()
    quality = DEFAULT_COMPRESSION[output_format] if compression is None else compression
    Image.open(io.BytesIO(png)).convert("RGB").save(buffer, format=output_format.upper(), quality=quality)
    return buffer.getvalue()


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WIDTHxHEIGHT"`` -> (height, width); ``auto`` or None: the model's default."""
    if size is None or size == "auto":
        return None, None
    width, height = (int(part) for part in size.split("x"))
    return height, width


def image_usage(result) -> ImageUsage | None:  # noqa: ANN001 - protocol.RequestFinished
    """What each image's step cache did (``usage.step_cache``), or None when no image had one."""
    if not result.step_cache:
        return None
    return ImageUsage(
        step_cache=[
            StepCacheUsage(
                **msgspec.structs.asdict(stats),
                computed_fraction=stats.computed_fraction,
                block_fraction=stats.block_fraction,
            )
            for stats in result.step_cache
        ]
    )


def images_router(state) -> APIRouter:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
    router = APIRouter()

    @router.post("/v1/images/generations", response_model=ImageGenerationResponse, response_model_exclude_none=True)
    async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
        adapter = state.check_model(body.model)
        for name in ("prompt", "negative_prompt"):
            state.check_text(name, getattr(body, name))
        state.check_task("text-to-image", "/v1/images/generations")
        height, width = parse_size(body.size)
        negative = body.negative_prompt if "negative_prompt" in body.model_fields_set else msgspec.UNSET
        resolved = state.resolve(
            GenerationRequest(
                prompt=body.prompt,
                negative_prompt=negative,
                n=body.n or 1,
                height=height,
                width=width,
                num_inference_steps=body.num_inference_steps,
                guidance_scale=body.guidance_scale,
                true_cfg_scale=body.true_cfg_scale,
                seed=body.seed,
                cache=body.cache,
                lora=adapter,
                lora_scale=body.lora_scale,
            )
        )
        result = await state.run(resolved, request)
        output_format = body.output_format or "png"
        data = [
            ImageData(
                b64_json=base64.b64encode(encode_image(png, output_format, body.output_compression)).decode("ascii")
            )
            for png in result.outputs
        ]
        response = ImageGenerationResponse(
            created=int(time.time()),
            data=data,
            output_format=output_format,
            size=f"{resolved.width}x{resolved.height}",
            usage=image_usage(result),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    return router
