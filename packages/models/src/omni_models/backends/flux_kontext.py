"""FLUX.1-Kontext (``FluxKontextPipeline``: image editing on the FLUX.1 transformer) as an omni family.

diffusers' ``FluxKontextPipeline`` is the math: the input image goes through the VAE (its distribution's mode,
shifted and scaled), is packed into 2x2 tokens like the latents, and is appended to every row's image tokens with
position ids whose first coordinate is 1 (the output's are 0); the transformer's velocity is read off the output
tokens only. Everything else is FLUX.1's (``omni_models.backends.flux``): text encoders, schedule (shifted by the
output's token count), embedded guidance, true CFG, the VAE decode.

What omni decides, each expressible as a ``FluxKontextPipeline`` call (the parity tests make those calls):

- the reference resolution: diffusers' auto-resize, the ``PREFERRED_KONTEXT_RESOLUTIONS`` entry nearest the input's
  aspect ratio, scaled by the checkpoint's native side / 1024 (1 for FLUX.1-Kontext-dev, so diffusers' default
  exactly) and rounded to the VAE's 16-pixel granularity;
- several input images are placed side by side (each resized to the first one's height, Lanczos) into one
  reference, the usual way to give Kontext several images (it was trained with one);
- the output size is the request's (``size=auto``: the first input's size fitted to the model's size range), not
  diffusers' ``max_area`` rescaling: pass ``max_area=height * width`` to diffusers for the same geometry.

The reference is preprocessed in ``prepare`` (host), encoded once per request in ``start`` (shared by its jobs and
both CFG rows) and freed in ``release`` (``omni_models.families.ReferenceConditioning``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from PIL import Image
from torch import Tensor

from omni_models.backends import flux
from omni_models.families import (
    FAMILY_ACCEPTS,
    DenoiseRow,
    FamilyPipeline,
    ReferenceConditioning,
    pack_latents,
)
from omni_models.limits import MAX_INPUT_IMAGES
from omni_models.request import ResolvedRequest
from omni_models.spec import ModelInfo, ModelSpec

# diffusers' PREFERRED_KONTEXT_RESOLUTIONS (width, height), the resolutions FLUX.1-Kontext was trained at; copied so
# that ``inspect`` and this module's import need no diffusers (tests/omni_server/test_edits.py checks it).
PREFERRED_RESOLUTIONS = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)
PREFERRED_SIDE = 1024  # the native side the preferred resolutions are for
DEFAULT_GUIDANCE = 2.5  # Black Forest Labs' FLUX.1-Kontext-dev card


def info(
    name: str,
    transformer_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    max_sequence_length: int | None,
    settings: Mapping[str, Any] | None = None,
) -> ModelInfo:
    base = flux.info(name, transformer_config, vae_config, max_sequence_length, settings)
    dev = bool(transformer_config.get("guidance_embeds"))
    image = base.image
    assert image is not None
    return msgspec.structs.replace(
        base,
        family="flux-kontext",
        variant="flux.1-kontext-dev" if dev else "flux.1-kontext",
        accepts=(*FAMILY_ACCEPTS, "image"),
        image=msgspec.structs.replace(
            image, default_guidance_scale=DEFAULT_GUIDANCE if dev else 1.0, max_input_images=MAX_INPUT_IMAGES
        ),
    )


FAMILY = dataclasses.replace(
    flux.FAMILY,
    name="flux-kontext",
    pipeline_class="FluxKontextPipeline",
    backend="omni_models.backends.flux_kontext:FluxKontextBackend",
    info=info,
    sequence_parallel=False,  # Ulysses is not checked against the appended reference tokens
)


def reference_size(height: int, width: int, native_side: int, multiple: int) -> tuple[int, int]:
    """(height, width) the reference is encoded at: the preferred resolution nearest in aspect ratio (diffusers'
    auto-resize: ties go to the smaller width), scaled to the native side, rounded to ``multiple``."""
    aspect = width / height
    _, preferred_w, preferred_h = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_RESOLUTIONS)
    scale = native_side / PREFERRED_SIDE

    def side(value: int) -> int:
        return max(multiple, int(value * scale / multiple + 0.5) * multiple)

    return side(preferred_h), side(preferred_w)


def side_by_side(images: Sequence[Image.Image]) -> Image.Image:
    """The images in one row, each resized (Lanczos) to the first one's height, keeping its aspect ratio."""
    if len(images) == 1:
        return images[0]
    height = images[0].height
    resized = [
        image if image.height == height else image.resize((max(1, round(image.width * height / image.height)), height))
        for image in images
    ]
    canvas = Image.new("RGB", (sum(image.width for image in resized), height))
    x = 0
    for image in resized:
        canvas.paste(image, (x, 0))
        x += image.width
    return canvas


class FluxKontextBackend(flux.FluxBackend):
    family = FAMILY

    def prepare_reference(self, request: ResolvedRequest) -> ReferenceConditioning | None:
        if not request.images:
            return None
        canvas = side_by_side([image.to_pil() for image in request.images])
        image_info = self.describe("").image
        assert image_info is not None and image_info.size_range is not None
        native = image_info.sizes[0][0]
        multiple = self.vae_scale_factor * 2
        height, width = reference_size(canvas.height, canvas.width, native, multiple)
        processor = self.pipeline.image_processor
        pixels = processor.preprocess(processor.resize(canvas, height, width), height, width)
        return ReferenceConditioning(
            pixels=[pixels], latent_shapes=((height // self.vae_scale_factor, width // self.vae_scale_factor),)
        )

    def encode_reference(self, reference: ReferenceConditioning) -> None:
        assert reference.pixels is not None
        pixels = reference.pixels[0].to(device=self.device, dtype=self.dtype)
        # FluxKontextPipeline's own encode: the latent distribution's mode, then (z - shift) * scale.
        latents = self.pipeline._encode_vae_image(image=pixels, generator=None)
        reference.latents = pack_latents(latents)[0]
        ids = flux._image_ids(*reference.latent_shapes[0], self.device, self.dtype).clone()
        ids[..., 0] = 1
        reference.ids = ids
        reference.pixels = None

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        reference = rows[0].reference
        if reference is None:
            return super().forward(rows, height, width)
        assert reference.latents is not None and reference.ids is not None
        output_tokens = rows[0].latents.shape[0]
        text = torch.stack([row.text.tokens for row in rows])
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([row.guidance for row in rows], dtype=torch.float32, device=self.device)
        hidden = torch.stack([torch.cat([row.latents, row.reference.latents]) for row in rows])
        velocity = self.transformer(
            hidden_states=hidden,
            timestep=self.timesteps(rows),
            guidance=guidance,
            pooled_projections=torch.stack([row.text.pooled for row in rows]),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=torch.cat([self.image_ids(height, width), reference.ids]),
            return_dict=False,
        )[0]
        return velocity[:, :output_tokens]


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.diffusers_adapter import inspect_family

    return inspect_family(FAMILY, directory, name)


def load(directory: Path, name: str, options: Any) -> FamilyPipeline:
    from omni_models.diffusers_adapter import load_family

    return load_family(FAMILY, directory, name, options)


def inspect_lora(directory: Path, path: Path, *, max_rank: int) -> Any:
    from omni_models.lora_files import inspect_family_lora

    return inspect_family_lora(FAMILY, directory, path, max_rank=max_rank)
