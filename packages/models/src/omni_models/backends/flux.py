"""FLUX.1 (``FluxPipeline``: dev with embedded guidance, schnell without) as an omni family.

diffusers' ``FluxTransformer2DModel`` and ``AutoencoderKL`` and transformers' CLIP and T5 encoders compute
everything; prompts go through the diffusers pipeline's own ``encode_prompt``. diffusers is imported only by
``omni_models.diffusers_adapter`` when a checkpoint is loaded: this module and ``inspect`` need none of it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from omni_models.families import (
    FAMILY_ACCEPTS,
    DenoiseRow,
    DiffusersBackend,
    DiffusersFamily,
    FamilyDeclaration,
    FamilyPipeline,
    Slot,
    TextEmbedding,
    packing_problem,
    unpack_latents,
)
from omni_models.family_attention import OmniFluxAttnProcessor
from omni_models.limits import MAX_IMAGES_PER_REQUEST, MAX_INFERENCE_STEPS
from omni_models.spec import ImageLimits, ModelInfo, ModelSpec, SizeRange

DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline's default latent side (1024 pixels at the VAE's factor 8), without a VAE size


def vae_scale_factor(vae_config: Mapping[str, Any]) -> int:
    return 2 ** (len(vae_config.get("block_out_channels", (64,))) - 1)


def default_max_sequence_length(transformer_config: Mapping[str, Any]) -> int:
    return 512 if transformer_config.get("guidance_embeds") else 256  # dev reads 512 T5 tokens, schnell 256


def info(
    name: str,
    transformer_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    max_sequence_length: int | None,
    settings: Mapping[str, Any] | None = None,
) -> ModelInfo:
    dev = bool(transformer_config.get("guidance_embeds"))
    factor = vae_scale_factor(vae_config)
    # The VAE's own sample size is the checkpoint's native side (1024 for FLUX.1, 64 for omni-flux-shapes-tiny).
    multiple, side = factor * 2, int(vae_config.get("sample_size") or DEFAULT_SAMPLE_SIZE * factor)
    return ModelInfo(
        name=name,
        family="flux",
        variant="flux.1-dev" if dev else "flux.1-schnell",
        task="text-to-image",
        accepts=FAMILY_ACCEPTS,
        transformer_blocks=transformer_config.get("num_layers", 19) + transformer_config.get("num_single_layers", 38),
        image=ImageLimits(
            sizes=((side, side),),
            size_range=SizeRange(multiple=multiple, min_side=multiple, max_side=2 * side),
            default_steps=28 if dev else 4,
            max_inference_steps=MAX_INFERENCE_STEPS,
            guidance="embedded" if dev else "true-cfg",
            default_guidance_scale=3.5 if dev else 1.0,
            true_cfg=dev,
            default_true_cfg_scale=1.0,
            max_images_per_request=MAX_IMAGES_PER_REQUEST,
            max_prompt_tokens=max_sequence_length or default_max_sequence_length(transformer_config),
        ),
    )


def check_configs(configs: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> str | None:
    transformer_config, vae_config = configs["transformer"], configs["vae"]
    return packing_problem(transformer_config, vae_config.get("latent_channels"))


FAMILY = DiffusersFamily(
    name="flux",
    pipeline_class="FluxPipeline",
    slots={
        "transformer": Slot("diffusers", ("FluxTransformer2DModel",), "model"),
        "vae": Slot("diffusers", ("AutoencoderKL",), "model"),
        "text_encoder": Slot("transformers", ("CLIPTextModel",), "model"),
        "text_encoder_2": Slot("transformers", ("T5EncoderModel",), "model"),
        "tokenizer": Slot("transformers", ("CLIPTokenizer", "CLIPTokenizerFast"), "tokenizer"),
        "tokenizer_2": Slot("transformers", ("T5Tokenizer", "T5TokenizerFast"), "tokenizer"),
        "scheduler": Slot("diffusers", ("FlowMatchEulerDiscreteScheduler",), "scheduler"),
    },
    # Kept in high precision under FP8: the input embedders (latents, text, timestep/guidance/pooled-text MLPs) and
    # the output norm and projection -- where FP8's error would reach every token and the FLOPs are negligible --
    # plus the per-block adaLN modulations, whose inputs are one row per image: FP8 saves nothing there and its
    # error scales and shifts every token (tests/omni_models/test_family_integrations.py measures it).
    declaration=FamilyDeclaration(
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        resident_modules=("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out"),
        fp8_ignore=(
            "x_embedder",
            "context_embedder",
            "time_text_embed.*",
            "norm_out.*",
            "proj_out",
            "transformer_blocks.*.norm1.linear",
            "transformer_blocks.*.norm1_context.linear",
            "single_transformer_blocks.*.norm.linear",
        ),
    ),
    backend="omni_models.backends.flux:FluxBackend",
    info=info,
    check_configs=check_configs,
    default_max_sequence_length=default_max_sequence_length,
    max_sequence_length_limit=512,
    sequence_parallel=True,
    ignored=("image_encoder", "feature_extractor"),
)


class FluxBackend(DiffusersBackend):
    family = FAMILY
    attention_processor = OmniFluxAttnProcessor
    compiled_vae_modules = ("decoder",)

    def uses_flow_sigmas(self, scheduler_config: Mapping[str, Any]) -> bool:
        return bool(scheduler_config.get("use_flow_sigmas", False))

    def encode(self, prompt: str) -> TextEmbedding:
        tokens, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return TextEmbedding(tokens[0], pooled[0])

    def image_ids(self, height: int, width: int) -> Tensor:
        return _image_ids(*self.latent_size(height, width), self.device, self.dtype)

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        text = torch.stack([row.text.tokens for row in rows])
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([row.guidance for row in rows], dtype=torch.float32, device=self.device)
        return self.transformer(
            hidden_states=torch.stack([row.latents for row in rows]),
            timestep=self.timesteps(rows),
            guidance=guidance,
            pooled_projections=torch.stack([row.text.pooled for row in rows]),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=self.image_ids(height, width),
            return_dict=False,
        )[0]

    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]:
        vae = self.pipeline.vae
        z = unpack_latents(torch.stack(list(latents)), *self.latent_size(height, width))
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        return self.postprocess(vae.decode(z, return_dict=False)[0])


@functools.lru_cache(maxsize=16)
def _image_ids(latent_h: int, latent_w: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """FLUX's image position ids ``[S, 3]`` (row, column) for a latent grid."""
    ids = torch.zeros(latent_h // 2, latent_w // 2, 3)
    ids[..., 1] += torch.arange(latent_h // 2)[:, None]
    ids[..., 2] += torch.arange(latent_w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.diffusers_adapter import inspect_family

    return inspect_family(FAMILY, directory, name)


def load(directory: Path, name: str, options: Any) -> FamilyPipeline:
    from omni_models.diffusers_adapter import load_family

    return load_family(FAMILY, directory, name, options)


def inspect_lora(directory: Path, path: Path, *, max_rank: int) -> Any:
    from omni_models.lora_files import inspect_family_lora

    return inspect_family_lora(FAMILY, directory, path, max_rank=max_rank)
