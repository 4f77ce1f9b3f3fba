"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``) as an omni video family.

diffusers' ``WanTransformer3DModel`` and ``AutoencoderKLWan``, transformers' UMT5 encoder and the checkpoint's own
scheduler (UniPC for the released checkpoints) compute everything; prompts go through ``WanPipeline``'s own
``encode_prompt`` (padded with zeros to ``max_sequence_length`` tokens, which the transformer reads whole, so
every row of a forward has the same text length). One backend covers:

- Wan2.1 T2V (1.3B, 14B): one transformer;
- Wan2.2 A14B: ``transformer`` (high noise) and ``transformer_2`` (low noise), switched where the timestep drops
  below ``boundary_ratio * num_train_timesteps`` (``model_index.json``), ``guidance_scale_2`` for the second;
- Wan2.2 TI2V-5B's text-to-video path (``expand_timesteps``: one timestep per latent token; its 48-channel VAE).

VAE decode is bounded in memory: ``AutoencoderKLWan`` decodes one latent frame at a time (its causal feature
cache) and videos are decoded one at a time. Frames of up to ``UNTILED_MAX_PIXELS`` (a 1280x720 frame) decode
whole, as ``WanPipeline`` does by default; larger ones go through diffusers' spatial tiling (256-pixel tiles at a
192 stride, ``AutoencoderKLWan.enable_tiling``), the frames diffusers gives with ``pipe.vae.enable_tiling()``. At
832x480, 81 frames on the H200 (2026-12-02e, one reading each), whole frames peaked at 13.6 GB of device memory
for the whole job and tiles at 7.4 GB, and tiling cost about 3 s a video.

diffusers is imported only by ``omni_models.diffusers_adapter`` when a checkpoint is loaded: this module and
``inspect`` need none of it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_models.families import (
    DenoiseRow,
    DiffusersBackend,
    DiffusersFamily,
    FamilyDeclaration,
    Slot,
    TextEmbedding,
)
from omni_models.family_attention import OmniWanAttnProcessor
from omni_models.limits import MAX_FPS, MAX_INFERENCE_STEPS, MAX_VIDEOS_PER_REQUEST
from omni_models.spec import ImageLimits, ModelInfo, ModelSpec, SizeRange, VideoLimits

UNTILED_MAX_PIXELS = 1280 * 720  # frames up to this size decode whole (the module docstring)

MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default prompt length (UMT5 tokens, zero-padded)
# A transformer narrower than this is a test checkpoint (the released ones are 1536 to 5120 wide): it gets small
# defaults (TINY_DEFAULTS) so a request that names nothing runs in seconds on a CPU.
TINY_WIDTH = 256
TINY_SIDE, TINY_FRAMES, TINY_STEPS, TINY_MAX_SIDE = 64, 9, 4, 128
RELEASED_MAX_SIDE = 1280  # 720p's long side
# The released checkpoints' defaults (Wan's model cards and WanPipeline): (height, width), frames, fps, steps,
# guidance, the low-noise expert's guidance.
WAN21 = ((480, 832), 81, 16, 50, 5.0, None)
WAN22_A14B = ((480, 832), 81, 16, 40, 4.0, 3.0)
WAN22_TI2V = ((704, 1280), 121, 24, 50, 5.0, None)
ACCEPTS = ("prompt", "negative_prompt", "size", "num_inference_steps", "guidance_scale", "n", "seed")
VIDEO_ACCEPTS = ("num_frames", "fps")


def _width(transformer_config: Mapping[str, Any]) -> int:
    return int(transformer_config.get("num_attention_heads", 40)) * int(
        transformer_config.get("attention_head_dim", 128)
    )


def _patch(transformer_config: Mapping[str, Any]) -> tuple[int, int, int]:
    return tuple(transformer_config.get("patch_size", (1, 2, 2)))  # type: ignore[return-value]


def info(
    name: str,
    transformer_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    max_sequence_length: int | None,
    settings: Mapping[str, Any] | None = None,
) -> ModelInfo:
    settings = settings or {}
    boundary = settings.get("boundary_ratio")
    experts = 1 if boundary is None else 2
    ti2v = bool(settings.get("expand_timesteps"))
    variant = "wan2.2-a14b" if experts == 2 else "wan2.2-ti2v" if ti2v else "wan2.1"
    size, frames, fps, steps, guidance, guidance_2 = WAN22_A14B if experts == 2 else WAN22_TI2V if ti2v else WAN21
    max_side = RELEASED_MAX_SIDE
    if _width(transformer_config) < TINY_WIDTH:
        size, frames, steps, max_side = (TINY_SIDE, TINY_SIDE), TINY_FRAMES, TINY_STEPS, TINY_MAX_SIDE
    multiple = int(vae_config.get("scale_factor_spatial") or 8) * _patch(transformer_config)[1]
    temporal = int(vae_config.get("scale_factor_temporal") or 4)
    return ModelInfo(
        name=name,
        family="wan",
        variant=variant,
        task="text-to-video",
        # The step cache reuses one transformer's middle residual, so it is not offered across two experts.
        accepts=(*ACCEPTS, *VIDEO_ACCEPTS, *(("guidance_scale_2",) if experts == 2 else ("cache",))),
        transformer_blocks=int(transformer_config.get("num_layers", 40)),
        image=ImageLimits(
            sizes=(size,),
            size_range=SizeRange(multiple=multiple, min_side=multiple, max_side=max_side),
            default_steps=steps,
            max_inference_steps=MAX_INFERENCE_STEPS,
            guidance="true-cfg",
            default_guidance_scale=guidance,
            default_true_cfg_scale=guidance,
            max_images_per_request=MAX_VIDEOS_PER_REQUEST,
            max_prompt_tokens=max_sequence_length or MAX_SEQUENCE_LENGTH,
        ),
        video=VideoLimits(
            default_num_frames=frames,
            max_num_frames=2 * (frames - 1) + 1,
            frame_multiple=temporal,
            default_fps=fps,
            max_fps=MAX_FPS,
            experts=experts,
            boundary_ratio=None if boundary is None else float(boundary),
            default_guidance_scale_2=guidance_2,
        ),
    )


def check_configs(configs: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> str | None:
    transformer, vae = configs["transformer"], configs["vae"]
    z_dim = vae.get("z_dim", 16)
    for key in ("in_channels", "out_channels"):
        if transformer.get(key, 16) != z_dim:
            return f"{key}={transformer.get(key, 16)} does not match the VAE's z_dim={z_dim}"
    if transformer.get("image_dim") is not None or transformer.get("added_kv_proj_dim") is not None:
        return "an image-to-video transformer (image_dim / added_kv_proj_dim) is not supported; only text-to-video"
    patch = _patch(transformer)
    if len(patch) != 3 or patch[1] != patch[2]:
        return f"patch_size={list(patch)} is not supported (a square spatial patch is)"
    boundary = settings.get("boundary_ratio")
    second = configs.get("transformer_2")
    if (boundary is None) != (second is None):
        return "boundary_ratio and transformer_2 come together (Wan2.2 A14B's two experts); this checkpoint has " + (
            "boundary_ratio without transformer_2" if second is None else "transformer_2 without boundary_ratio"
        )
    if boundary is not None:
        if isinstance(boundary, bool) or not isinstance(boundary, (int, float)) or not 0.0 < boundary < 1.0:
            return f"boundary_ratio must be a number in (0, 1), got {boundary!r}"
        for key in ("in_channels", "out_channels", "patch_size", "text_dim"):
            if second.get(key) != transformer.get(key):
                return f"transformer_2's {key}={second.get(key)!r} differs from transformer's {transformer.get(key)!r}"
    return None


FAMILY = DiffusersFamily(
    name="wan",
    pipeline_class="WanPipeline",
    slots={
        "transformer": Slot("diffusers", ("WanTransformer3DModel",), "model"),
        "transformer_2": Slot("diffusers", ("WanTransformer3DModel",), "model", optional=True),
        "vae": Slot("diffusers", ("AutoencoderKLWan",), "model"),
        "text_encoder": Slot("transformers", ("UMT5EncoderModel",), "model"),
        "tokenizer": Slot("transformers", ("T5Tokenizer", "T5TokenizerFast"), "tokenizer"),
        "scheduler": Slot("diffusers", ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"), "scheduler"),
    },
    # High precision under FP8: the patch embedding, the timestep/text embedders (the per-step modulation comes
    # from condition_embedder.time_proj: one row per video, FP8 would save nothing) and the output projection.
    declaration=FamilyDeclaration(
        block_lists=("blocks",),
        resident_modules=("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"),
        fp8_ignore=("patch_embedding", "condition_embedder.*", "proj_out"),
        block_call="cross",
    ),
    backend="omni_models.backends.wan:WanBackend",
    pipeline="omni_models.video_family:VideoFamilyPipeline",
    info=info,
    check_configs=check_configs,
    default_max_sequence_length=lambda _config: MAX_SEQUENCE_LENGTH,
    max_sequence_length_limit=MAX_SEQUENCE_LENGTH,
    settings=("boundary_ratio", "expand_timesteps"),
    denoisers=("transformer", "transformer_2"),
    # Wan's own code and diffusers' Wan examples decode in float32 (the VAE is small; bf16 decoding shows banding).
    float32_components=("vae",),
    lora=False,
    sequence_parallel=True,  # each rank a band of patch rows (omni_models.family_parallel)
)


class WanBackend(DiffusersBackend):
    family = FAMILY
    attention_processor = OmniWanAttnProcessor

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype, max_sequence_length: int) -> None:
        super().__init__(pipeline, device=device, dtype=dtype, max_sequence_length=max_sequence_length)
        self.vae_scale_factor = pipeline.vae_scale_factor_spatial
        self.temporal_factor = pipeline.vae_scale_factor_temporal
        self.latent_channels = self.transformer.config.in_channels
        self.denoisers = [pipeline.transformer] + ([pipeline.transformer_2] if pipeline.transformer_2 else [])
        config = pipeline.config
        self.boundary = (
            None
            if config.boundary_ratio is None
            else config.boundary_ratio * pipeline.scheduler.config.num_train_timesteps
        )
        self.expand_timesteps = bool(config.expand_timesteps)
        pipeline.vae.enable_tiling()  # diffusers' default tiles; ``decode_video`` turns them on by frame size

    def compile_targets(self) -> list[torch.nn.Module]:
        """Every block of every expert (the VAE decoder is not compiled: its causal feature cache is Python state
        that changes every frame)."""
        return [block for model in self.denoisers for block in model.blocks]

    def encoder_settings(self) -> tuple:
        return (*super().encoder_settings(), "wan")

    def encode(self, prompt: str) -> TextEmbedding:
        tokens, _ = self.pipeline.encode_prompt(
            prompt=prompt,
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return TextEmbedding(tokens[0].to(self.dtype), None)

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (
            self.latent_channels,
            (num_frames - 1) // self.temporal_factor + 1,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
        )

    def initial_latents(self, seed: int, num_frames: int, height: int, width: int) -> Tensor:  # type: ignore[override]
        """diffusers' draw for ``generator=torch.Generator("cpu").manual_seed(seed)``: float32 ``[C, T', H', W']``."""
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn((1, *self.latent_shape(num_frames, height, width)), generator=generator)
        return noise[0].to(self.device)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - one backend per loaded pipeline
    def _scheduler_for(self, num_steps: int) -> Any:
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        scheduler.set_timesteps(num_steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def job_scheduler(self, num_steps: int) -> Any:
        """A fresh copy of the checkpoint's scheduler set to ``num_steps`` (UniPC keeps per-video history)."""
        return copy.deepcopy(self._scheduler_for(num_steps))

    def experts(self, timesteps: Tensor) -> tuple[int, ...]:
        """The denoiser of each step: 0 (``transformer``) at or above the boundary timestep, else 1."""
        if self.boundary is None:
            return (0,) * len(timesteps)
        return tuple(0 if float(t) >= self.boundary else 1 for t in timesteps)

    def forward(self, rows: Sequence[DenoiseRow], expert: int) -> Tensor:  # type: ignore[override]
        latents = torch.stack([row.latents for row in rows]).to(self.dtype)
        timestep = torch.stack([row.timestep for row in rows])
        if self.expand_timesteps:  # one timestep per latent token (TI2V; all equal without an input image)
            _, frames, height, width = rows[0].latents.shape
            _, p_h, p_w = _patch(self.transformer.config)
            tokens = frames * (height // p_h) * (width // p_w)
            timestep = timestep.to(torch.float32)[:, None].expand(-1, tokens)
        return self.denoisers[expert](
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=torch.stack([row.text.tokens for row in rows]),
            return_dict=False,
        )[0]

    def decode_video(self, latents: Tensor) -> np.ndarray:
        """One video's frames ``(T, H, W, 3)`` as floats in [0, 1], as ``WanPipeline`` decodes them."""
        vae = self.pipeline.vae
        height, width = (side * self.vae_scale_factor for side in latents.shape[-2:])
        vae.use_tiling = height * width > UNTILED_MAX_PIXELS
        z = latents[None].to(vae.dtype)
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        video = vae.decode(z / inverse_std + mean, return_dict=False)[0]
        return self.pipeline.video_processor.postprocess_video(video, output_type="np")[0]


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.diffusers_adapter import inspect_family

    return inspect_family(FAMILY, directory, name)


def load(directory: Path, name: str, options: Any) -> Any:
    from omni_models.diffusers_adapter import load_family

    return load_family(FAMILY, directory, name, options)
