"""Qwen-Image-Edit-2509 (``QwenImageEditPlusPipeline``: one to three input images, true CFG) and Qwen-Image-Edit
(``QwenImageEditPipeline``: one image) as omni families.

diffusers' ``QwenImageEditPlusPipeline`` is the math; everything it shares with Qwen-Image (the transformer and
its ragged-text forward, the schedule, the norm-rescaled true CFG, the VAE decode) is ``omni_models.backends.
qwen_image``'s. What the edit adds, each image of the request:

- a *condition* image (the ``CONDITION_IMAGE_SIZE`` area at the image's aspect ratio, sides multiples of 32) that
  Qwen2.5-VL reads inside the prompt (``Picture i: <|vision_start|><|image_pad|><|vision_end|>`` before the
  instruction, the edit prompt template), so the prompt embeddings depend on the images;
- a *VAE* image (the ``VAE_IMAGE_SIZE`` area) whose latents (the distribution's mode, normalised by the VAE's
  mean and std) are appended to every row's image tokens with their own RoPE grid (``img_shapes``); the velocity is
  read off the output tokens only.

Both areas are diffusers' (1024² and 384²) for a checkpoint of the native 1024 side, scaled by native side / 1024
otherwise (tiny test checkpoints); pass the same areas to diffusers for the same images.

Per request: ``prepare`` resizes and preprocesses on the host (the VAE pixels, the processor's ``pixel_values``);
``start`` encodes the VAE latents and runs Qwen2.5-VL's vision tower once (``ReferenceConditioning.vision_features``),
then encodes the prompt and the negative prompt with those features (transformers' ``mm_encoder_outputs``, through
the pipeline's own ``_get_qwen_prompt_embeds``); ``release`` frees them. The edit needs images: a request without
any is refused (``ImageLimits.min_input_images``).

The Qwen2-VL processor is built without torchvision (``omni_models.diffusers_adapter``: the same ``pixel_values``
as transformers' torchvision processor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from omni_models.backends import qwen_image
from omni_models.families import (
    FAMILY_ACCEPTS,
    DenoiseRow,
    FamilyPipeline,
    ReferenceConditioning,
    Slot,
    TextEmbedding,
    pack_latents,
)
from omni_models.request import ResolvedRequest
from omni_models.spec import ModelInfo, ModelSpec

# diffusers' pipeline_qwenimage_edit_plus constants (areas in pixels at the native 1024 side); copied so that
# ``inspect`` and this module's import need no diffusers (the tests check them).
CONDITION_IMAGE_SIZE = 384 * 384
VAE_IMAGE_SIZE = 1024 * 1024
NATIVE_SIDE = 1024
MAX_INPUT_IMAGES = 3  # Qwen-Image-Edit-2509 takes one to three images


def _info(variant: str, max_images: int):
    def info(
        name: str,
        transformer_config: Mapping[str, Any],
        vae_config: Mapping[str, Any],
        max_sequence_length: int | None,
        settings: Mapping[str, Any] | None = None,
    ) -> ModelInfo:
        base = qwen_image.info(name, transformer_config, vae_config, max_sequence_length, settings)
        image = base.image
        assert image is not None
        return msgspec.structs.replace(
            base,
            family="qwen-image-edit",
            variant=variant,
            accepts=(*FAMILY_ACCEPTS, "image"),
            image=msgspec.structs.replace(image, min_input_images=1, max_input_images=max_images),
        )

    return info


FAMILY = dataclasses.replace(
    qwen_image.FAMILY,
    name="qwen-image-edit-plus",
    pipeline_class="QwenImageEditPlusPipeline",
    slots={
        **qwen_image.FAMILY.slots,
        "processor": Slot("transformers", ("Qwen2VLProcessor",), "processor"),
    },
    backend="omni_models.backends.qwen_image_edit:QwenImageEditPlusBackend",
    info=_info("qwen-image-edit-plus", MAX_INPUT_IMAGES),
)
# Qwen-Image-Edit (the first release: ``QwenImageEditPipeline``): one image, which Qwen2.5-VL and the VAE both read
# at the VAE area (its prompt template holds the one image's tokens).
EDIT_FAMILY = dataclasses.replace(
    FAMILY,
    name="qwen-image-edit",
    pipeline_class="QwenImageEditPipeline",
    backend="omni_models.backends.qwen_image_edit:QwenImageEditBackend",
    info=_info("qwen-image-edit", 1),
)


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """(width, height) of ``target_area`` at aspect ratio ``ratio`` (width / height), sides rounded to 32: the
    arithmetic of diffusers' ``calculate_dimensions`` (the tests check it against diffusers')."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def reference_areas(native_side: int) -> tuple[float, float]:
    """(condition area, VAE area) for a checkpoint whose native side is ``native_side``."""
    scale = (native_side / NATIVE_SIDE) ** 2
    return CONDITION_IMAGE_SIZE * scale, VAE_IMAGE_SIZE * scale


@contextlib.contextmanager
def _image_features(text_encoder: Any, features: Any) -> Iterator[None]:
    """Inside: the text encoder's forward reads ``features`` as its image features instead of running the vision
    tower again (transformers' ``mm_encoder_outputs``)."""
    forward = text_encoder.forward

    def with_features(*args: Any, pixel_values: Any = None, **kwargs: Any) -> Any:
        return forward(*args, mm_encoder_outputs={"image": features}, **kwargs)

    text_encoder.forward = with_features
    try:
        yield
    finally:
        del text_encoder.forward


class QwenImageEditPlusBackend(qwen_image.QwenImageBackend):
    family = FAMILY

    def _native_side(self) -> int:
        image = self.describe("").image
        assert image is not None
        return image.sizes[0][0]

    def prepare_reference(self, request: ResolvedRequest) -> ReferenceConditioning | None:
        if not request.images:
            raise ValueError("Qwen-Image-Edit needs at least one input image")  # resolve_request refuses it first
        condition_area, vae_area = reference_areas(self._native_side())
        processor = self.pipeline.image_processor
        condition_images, pixels, shapes = [], [], []
        for image in request.images:
            pil = image.to_pil()
            ratio = pil.width / pil.height
            condition_w, condition_h = calculate_dimensions(condition_area, ratio)
            vae_w, vae_h = calculate_dimensions(vae_area, ratio)
            condition_images.append(processor.resize(pil, condition_h, condition_w))
            pixels.append(processor.preprocess(pil, vae_h, vae_w).unsqueeze(2))
            shapes.append((vae_h // self.vae_scale_factor, vae_w // self.vae_scale_factor))
        return ReferenceConditioning(pixels=pixels, latent_shapes=tuple(shapes), vision_inputs=condition_images)

    def encode_reference(self, reference: ReferenceConditioning) -> None:
        assert reference.pixels is not None
        latents = []
        for pixels in reference.pixels:
            # QwenImageEditPlusPipeline's own encode: the latent distribution's mode, normalised per channel.
            pixels = pixels.to(device=self.device, dtype=self.dtype)
            encoded = self.pipeline._encode_vae_image(image=pixels, generator=None)
            latents.append(pack_latents(encoded[:, :, 0])[0])
        reference.latents = torch.cat(latents)
        reference.pixels = None
        # Qwen2.5-VL's vision tower, once per request: every prompt of the request reads these features.
        inputs = self.pipeline.processor.image_processor(images=reference.vision_inputs, return_tensors="pt")
        model = self.pipeline.text_encoder.model
        reference.vision_features = model.get_image_features(
            inputs["pixel_values"].to(self.device), inputs["image_grid_thw"].to(self.device), return_dict=True
        )

    def encode_with_reference(self, prompt: str, reference: ReferenceConditioning) -> TextEmbedding:
        assert reference.vision_features is not None
        with _image_features(self.pipeline.text_encoder, reference.vision_features):
            tokens, mask = self.pipeline._get_qwen_prompt_embeds(
                [prompt], list(reference.vision_inputs), self.device, self.dtype
            )
        return TextEmbedding(tokens[0, : int(mask[0].sum())], None)

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        reference = rows[0].reference
        assert reference is not None and reference.latents is not None  # every request of this family has images
        lengths = [row.text.tokens.shape[0] for row in rows]
        text = rows[0].text.tokens.new_zeros(len(rows), max(lengths), rows[0].text.tokens.shape[1])
        for i, row in enumerate(rows):
            text[i, : lengths[i]] = row.text.tokens
        latent_h, latent_w = self.latent_size(height, width)
        output_tokens = rows[0].latents.shape[0]
        shapes = [(1, latent_h // 2, latent_w // 2), *((1, h // 2, w // 2) for h, w in reference.latent_shapes)]
        velocity = self.transformer(
            hidden_states=torch.stack([torch.cat([row.latents, row.reference.latents]) for row in rows]),
            encoder_hidden_states=text,
            timestep=self.timesteps(rows),
            img_shapes=[shapes] * len(rows),
            attention_kwargs={"text_lengths": torch.tensor(lengths)},
            return_dict=False,
        )[0]
        return velocity[:, :output_tokens]


class QwenImageEditBackend(QwenImageEditPlusBackend):
    family = EDIT_FAMILY

    def prepare_reference(self, request: ResolvedRequest) -> ReferenceConditioning | None:
        if len(request.images) != 1:
            raise ValueError("Qwen-Image-Edit takes one input image")  # resolve_request refuses others first
        pil = request.images[0].to_pil()
        _, vae_area = reference_areas(self._native_side())
        width, height = calculate_dimensions(vae_area, pil.width / pil.height)
        processor = self.pipeline.image_processor
        resized = processor.resize(pil, height, width)  # what Qwen2.5-VL reads and the VAE encodes
        pixels = processor.preprocess(resized, height, width).unsqueeze(2)
        shape = (height // self.vae_scale_factor, width // self.vae_scale_factor)
        return ReferenceConditioning(pixels=[pixels], latent_shapes=(shape,), vision_inputs=[resized])


def _family(directory: Path) -> Any:
    from omni_models.registry import kind_of

    return EDIT_FAMILY if kind_of(directory).pipeline_class == EDIT_FAMILY.pipeline_class else FAMILY


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.diffusers_adapter import inspect_family

    return inspect_family(_family(directory), directory, name)


def load(directory: Path, name: str, options: Any) -> FamilyPipeline:
    from omni_models.diffusers_adapter import load_family

    return load_family(_family(directory), directory, name, options)


def inspect_lora(directory: Path, path: Path, *, max_rank: int) -> Any:
    from omni_models.lora_files import inspect_family_lora

    return inspect_family_lora(_family(directory), directory, path, max_rank=max_rank)
