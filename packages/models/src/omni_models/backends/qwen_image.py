"""Qwen-Image (``QwenImagePipeline``, true CFG) as an omni family.

diffusers' ``QwenImageTransformer2DModel`` and ``AutoencoderKLQwenImage`` and transformers' Qwen2.5-VL text
encoder compute everything; prompts go through the diffusers pipeline's own ``encode_prompt``. Rows whose prompts
have different lengths share one forward (``OmniQwenImageAttnProcessor`` with ``text_lengths``).
"""

from __future__ import annotations

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
from omni_models.family_attention import OmniQwenImageAttnProcessor
from omni_models.limits import MAX_IMAGES_PER_REQUEST, MAX_INFERENCE_STEPS
from omni_models.spec import ImageLimits, ModelInfo, ModelSpec, SizeRange

DEFAULT_SAMPLE_SIZE = 128  # QwenImagePipeline's default latent side
DEFAULT_MAX_SEQUENCE_LENGTH = 512
# Transformer options of Qwen-Image's edit and distilled variants, which this family does not run.
VARIANT_OPTIONS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


def vae_scale_factor(vae_config: Mapping[str, Any]) -> int:
    return 2 ** len(vae_config.get("temperal_downsample", (False, True, True)))


def info(
    name: str,
    transformer_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    max_sequence_length: int | None,
    settings: Mapping[str, Any] | None = None,
) -> ModelInfo:
    factor = vae_scale_factor(vae_config)
    # The native side: QwenImagePipeline's default (128 latents), or a VAE config's ``sample_size`` where it has one
    # (not a field of AutoencoderKLQwenImage: omni's tiny edit checkpoints set it so their references stay small).
    multiple, side = factor * 2, int(vae_config.get("sample_size") or DEFAULT_SAMPLE_SIZE * factor)
    return ModelInfo(
        name=name,
        family="qwen-image",
        variant="qwen-image",
        task="text-to-image",
        accepts=FAMILY_ACCEPTS,
        transformer_blocks=transformer_config.get("num_layers", 60),
        image=ImageLimits(
            sizes=((side, side),),
            size_range=SizeRange(multiple=multiple, min_side=multiple, max_side=2 * side),
            default_steps=50,
            max_inference_steps=MAX_INFERENCE_STEPS,
            guidance="true-cfg",
            default_guidance_scale=4.0,
            default_true_cfg_scale=4.0,
            # diffusers applies true CFG only with a negative prompt and documents " " for CFG without one.
            default_negative_prompt=" ",
            max_images_per_request=MAX_IMAGES_PER_REQUEST,
            max_prompt_tokens=max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH,
        ),
    )


def check_configs(configs: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> str | None:
    transformer_config, vae_config = configs["transformer"], configs["vae"]
    problem = packing_problem(transformer_config, vae_config.get("z_dim"))
    if problem is not None:
        return problem
    for option in VARIANT_OPTIONS:
        if transformer_config.get(option):
            return f"{option}=true (a Qwen-Image edit/distilled variant) is not supported"
    return None


FAMILY = DiffusersFamily(
    name="qwen-image",
    pipeline_class="QwenImagePipeline",
    slots={
        "transformer": Slot("diffusers", ("QwenImageTransformer2DModel",), "model"),
        "vae": Slot("diffusers", ("AutoencoderKLQwenImage",), "model"),
        "text_encoder": Slot("transformers", ("Qwen2_5_VLForConditionalGeneration",), "model"),
        "tokenizer": Slot("transformers", ("Qwen2Tokenizer", "Qwen2TokenizerFast"), "tokenizer"),
        "scheduler": Slot("diffusers", ("FlowMatchEulerDiscreteScheduler",), "scheduler"),
    },
    # High precision under FP8: the embedders, the output norm and projection, the per-block modulations (see the
    # FLUX declaration for why).
    declaration=FamilyDeclaration(
        block_lists=("transformer_blocks",),
        resident_modules=("img_in", "txt_norm", "txt_in", "time_text_embed", "norm_out", "proj_out"),
        fp8_ignore=(
            "img_in",
            "txt_in",
            "time_text_embed.*",
            "norm_out.*",
            "proj_out",
            "transformer_blocks.*.img_mod.1",
            "transformer_blocks.*.txt_mod.1",
        ),
    ),
    backend="omni_models.backends.qwen_image:QwenImageBackend",
    info=info,
    check_configs=check_configs,
    default_max_sequence_length=lambda _config: DEFAULT_MAX_SEQUENCE_LENGTH,
    max_sequence_length_limit=1024,
)


class QwenImageBackend(DiffusersBackend):
    family = FAMILY
    attention_processor = OmniQwenImageAttnProcessor

    def encode(self, prompt: str) -> TextEmbedding:
        tokens, mask = self.pipeline.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        if mask is not None:  # only padding is masked, and one prompt alone is never padded
            tokens = tokens[:, : int(mask[0].sum())]
        return TextEmbedding(tokens[0], None)

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        lengths = [row.text.tokens.shape[0] for row in rows]
        text = rows[0].text.tokens.new_zeros(len(rows), max(lengths), rows[0].text.tokens.shape[1])
        for i, row in enumerate(rows):
            text[i, : lengths[i]] = row.text.tokens
        latent_h, latent_w = self.latent_size(height, width)
        return self.transformer(
            hidden_states=torch.stack([row.latents for row in rows]),
            encoder_hidden_states=text,
            timestep=self.timesteps(rows),
            img_shapes=[[(1, latent_h // 2, latent_w // 2)]] * len(rows),
            # A CPU tensor, so a compiled block guards on neither the lengths nor their count (joint_attention).
            attention_kwargs={"text_lengths": torch.tensor(lengths)},
            return_dict=False,
        )[0]

    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """True CFG, then rescaled per token to the conditional prediction's norm (as QwenImagePipeline does)."""
        combined = super().guide(cond, uncond, scale)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]:
        vae = self.pipeline.vae
        z = unpack_latents(torch.stack(list(latents)), *self.latent_size(height, width)).unsqueeze(2).to(vae.dtype)
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        return self.postprocess(vae.decode(z / inverse_std + mean, return_dict=False)[0][:, :, 0])


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.diffusers_adapter import inspect_family

    return inspect_family(FAMILY, directory, name)


def load(directory: Path, name: str, options: Any) -> FamilyPipeline:
    from omni_models.diffusers_adapter import load_family

    return load_family(FAMILY, directory, name, options)


def inspect_lora(directory: Path, path: Path, *, max_rank: int) -> Any:
    from omni_models.lora_files import inspect_family_lora

    return inspect_family_lora(FAMILY, directory, path, max_rank=max_rank)
