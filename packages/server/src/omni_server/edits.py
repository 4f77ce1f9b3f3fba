"""``POST /v1/images/edits``: the OpenAI image edits API (multipart/form-data) over the one engine.

The form is read once (the guard has already bounded the body: ``ServerConfig.max_form_body_bytes``) and every
part is accounted for: ``image`` / ``image[]`` files (one or several) and the text fields OpenAI defines or omni
adds (``EDIT_FIELDS``). A part that is neither, a repeated text field, a file where text belongs or text where a
file belongs is a 400 naming it; so is every value omni cannot honour (``mask``: the served families do no
inpainting; ``response_format=url``; ``background=transparent``; ``input_fidelity``, ``svg``, ``markup`` and the
animation fields, which it has no mechanism for). Each image is decoded and checked by
``omni_models.decode_input_image`` (bytes and pixels bounded by ``--max-input-image-bytes`` and
``--max-input-image-pixels``; modes converted or refused with the reason). Then the request is the one request type
(``GenerationRequest`` with ``images``), checked once against the model and run like a generation; the response is
the generations route's (``ImagesResponse``: ``created``, ``data[].b64_json``, ``output_format``, ``size``).

Form values are text, so the numbers are parsed here; ``negative_prompt`` given (even empty) is that text, omitted
is the model's default (a form has no null). omni's extensions are the generations route's: ``cache`` (a step-cache
preset name or a JSON object of knobs; the response's ``usage.step_cache`` says what it did), LoRA by ``model`` (a
served adapter's name) with ``lora_scale``; a model that cannot is refused by the one request check, naming the
field.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from omni_models import GenerationRequest, InvalidRequestError, decode_input_image
from omni_models.limits import (
    MAX_GUIDANCE_SCALE,
    MAX_IMAGES_PER_REQUEST,
    MAX_INFERENCE_STEPS,
    MAX_INPUT_IMAGES,
    MAX_SEED,
)
from omni_server.errors import invalid_field
from omni_server.images import encode_image, image_usage, parse_size
from omni_server.schemas import ImageData, ImageGenerationResponse

EDITS_PATH = "/v1/images/edits"
IMAGE_FIELDS = ("image", "image[]")
SIZE_PATTERN = re.compile(r"auto|[0-9]{1,5}x[0-9]{1,5}")


def _integer(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        if not re.fullmatch(r"\s*[0-9]{1,20}\s*", text) or not low <= int(text) <= high:
            raise invalid_field(name, f"{name} must be an integer in [{low}, {high}], got {text[:40]!r}")
        return int(text)

    return parse


def _scale(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 <= value <= MAX_GUIDANCE_SCALE:
        raise invalid_field(name, f"{name} must be a finite number in [0, {MAX_GUIDANCE_SCALE:g}], got {text[:40]!r}")
    return value


def _choice(*allowed: str, why: str = "") -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if text not in allowed:
            listed = " or ".join(repr(a) for a in allowed)
            raise invalid_field(name, f"{name} must be {listed}{why}, got {text[:40]!r}")
        return text

    return parse


def _text(name: str, text: str) -> str:
    return text


def _size(name: str, text: str) -> str:
    if not SIZE_PATTERN.fullmatch(text):
        raise invalid_field(name, f"size must be auto or WIDTHxHEIGHT, e.g. 512x512; got {text[:40]!r}")
    return text


def _cache(name: str, text: str) -> str | dict[str, Any]:
    """A step-cache preset name, or a JSON object of knobs (what the generations route's ``cache`` takes)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid_field(name, f"cache must be a preset name or a JSON object of knobs; {exc}") from None
    if not isinstance(value, dict):
        raise invalid_field(name, "cache must be a preset name or a JSON object of knobs")
    return value


def _lora_scale(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise invalid_field(name, f"lora_scale must be a finite number, got {text[:40]!r}")
    return value  # its range is the request rules' (resolve_request)


def _refused(why: str) -> Callable[[str, str], Any]:
    def parse(name: str, text: str) -> Any:
        raise invalid_field(name, f"{name} is not supported: {why}")

    return parse


# Every text field the OpenAI SDK's images.edit can send, and omni's extensions; each parsed or refused by name.
EDIT_FIELDS: dict[str, Callable[[str, str], Any]] = {
    "prompt": _text,
    "model": _text,
    "n": _integer(1, MAX_IMAGES_PER_REQUEST),
    "size": _size,
    "response_format": _choice("b64_json", why=" (images are returned inline)"),
    "output_format": _choice("png", "jpeg", "webp"),
    "output_compression": _integer(0, 100),
    "quality": _choice("auto", why=" (the model's own quality)"),
    "background": _choice("auto", "opaque", why=" (images are opaque RGB)"),
    "moderation": _choice("auto", "low", why=" (there is no moderation)"),
    "stream": _choice("false", "False", "0", why=" (one response with every image)"),
    "partial_images": _choice("0", why=" (no streaming)"),
    "user": _text,
    "safety_identifier": _text,
    "input_fidelity": _refused("the model always conditions on the whole input image; it has no fidelity control"),
    "complexity": _refused("omni's edit models have no complexity control"),
    "frame_count": _refused("omni edits still images"),
    "frame_duration_ms": _refused("omni edits still images"),
    "svg": _refused("omni writes raster images (png, jpeg, webp)"),
    "markup": _refused("omni's edit models take no markup"),
    "mask": _refused("the served model does no inpainting; edit with the prompt instead"),
    "negative_prompt": _text,
    "num_inference_steps": _integer(1, MAX_INFERENCE_STEPS),
    "guidance_scale": _scale,
    "true_cfg_scale": _scale,
    "seed": _integer(0, MAX_SEED),
    "cache": _cache,
    "lora_scale": _lora_scale,
}


def _base_name(name: str) -> str:
    """``svg[fill]`` (how multipart writes a nested value) -> ``svg``."""
    return name.split("[", 1)[0] if "[" in name and name not in IMAGE_FIELDS else name


async def read_edit_form(request: Request) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """The parsed text fields and the image files ``(field name, bytes)`` of an edits form; 400 naming the part."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid_field(None, "the edits route takes a multipart/form-data body (files and text fields)")
    try:
        form = await request.form(max_files=MAX_INPUT_IMAGES + 1, max_fields=len(EDIT_FIELDS) + 8)
    except Exception as exc:  # starlette's MultiPartException / HTTPException: a malformed or oversized form
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
        raise invalid_field(None, f"the multipart form cannot be read: {detail}") from None
    fields: dict[str, Any] = {}
    images: list[tuple[str, bytes]] = []
    try:
        for name, value in form.multi_items():
            base = _base_name(name)
            if name in IMAGE_FIELDS:
                if not isinstance(value, UploadFile):
                    raise invalid_field("image", f"{name} must be a file part (an image file), got a text field")
                if len(images) == MAX_INPUT_IMAGES:
                    raise invalid_field("image", f"more than {MAX_INPUT_IMAGES} input images")
                images.append((name, await value.read()))
                continue
            parse = EDIT_FIELDS.get(base)
            if parse is None:
                raise invalid_field(
                    base, f"unknown field {name[:60]!r}; the edits route takes {', '.join(EDIT_FIELDS)}"
                )
            if isinstance(value, UploadFile) and base != "mask":  # mask is refused below, file or not
                raise invalid_field(base, f"{base} must be a text field, got a file")
            if base in fields:
                raise invalid_field(base, f"{base} is given twice")
            fields[base] = parse(base, value if isinstance(value, str) else "")
    finally:
        await form.close()
    if "prompt" not in fields or not fields["prompt"].strip():
        raise invalid_field("prompt", "prompt is required: a non-empty text describing the edit")
    if not images:
        raise invalid_field("image", "image is required: one or more image files (image or image[])")
    return fields, images


def edits_router(state) -> APIRouter:  # noqa: ANN001 - api.ServerState (an import cycle otherwise)
    router = APIRouter()
    config = state.config

    @router.post(
        EDITS_PATH,
        response_model=ImageGenerationResponse,
        response_model_exclude_none=True,
        openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {"type": "object"}}}}},
    )
    async def edit_images(request: Request) -> Response:
        fields, files = await read_edit_form(request)
        adapter = state.check_model(fields.get("model"))  # a LoRA adapter's name selects it, as on generations
        for name in ("prompt", "negative_prompt"):
            state.check_text(name, fields.get(name))
        info = state.info()
        if "image" not in info.accepts:
            raise invalid_field(
                "model",
                f"{EDITS_PATH} needs an image editing model; {config.model_name!r} ({info.variant}) takes no input "
                "images",
                code="model_not_supported",
            )

        def decode_all() -> list[Any]:
            return [
                decode_input_image(
                    data, max_bytes=config.max_input_image_bytes, max_pixels=config.max_input_image_pixels, param=name
                )
                for name, data in files
            ]

        try:
            images = await asyncio.to_thread(decode_all)
        except InvalidRequestError as exc:
            raise invalid_field("image", str(exc)) from None
        height, width = parse_size(fields.get("size"))
        resolved = state.resolve(
            GenerationRequest(
                prompt=fields["prompt"],
                negative_prompt=fields.get("negative_prompt", msgspec.UNSET),
                n=fields.get("n", 1),
                height=height,
                width=width,
                num_inference_steps=fields.get("num_inference_steps"),
                guidance_scale=fields.get("guidance_scale"),
                true_cfg_scale=fields.get("true_cfg_scale"),
                seed=fields.get("seed"),
                images=tuple(images),
                cache=fields.get("cache"),
                lora=adapter,
                lora_scale=fields.get("lora_scale"),
            )
        )
        result = await state.run(resolved, request)
        output_format = fields.get("output_format", "png")
        compression = fields.get("output_compression")
        data = [
            ImageData(b64_json=base64.b64encode(encode_image(png, output_format, compression)).decode("ascii"))
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


__all__ = ["EDITS_PATH", "EDIT_FIELDS", "edits_router", "read_edit_form"]
