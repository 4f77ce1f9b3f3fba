"""omni-flux-shapes-tiny: a FLUX.1-dev-architecture model of the shapes world, made of diffusers' and
transformers' own classes only, so diffusers' ``FluxPipeline`` loads and renders it with no omni code.

Components (the ``FluxPipeline`` constructor arguments):
- ``FluxTransformer2DModel``: double-stream and single-stream blocks, 3-axis RoPE, embedded guidance
  (``guidance_embeds=True``, FLUX.1-dev style: guidance is an input, not a second forward);
- ``AutoencoderKL`` with FLUX's 16 latent channels and 4x downsampling (three blocks, no quant convs), its
  ``shift_factor``/``scaling_factor`` measured on the training latents;
- small ``CLIPTextModel`` (pooled prompt vector) and ``T5EncoderModel`` (per-token embeddings);
- tokenizers written from the shapes vocabulary (``omni_models.synthetic``);
- the checkpoint's own ``FlowMatchEulerDiscreteScheduler`` config: FLUX.1-dev's dynamic shift.

Geometry: the 32x32 shapes world drawn at 64x64 (every scorer pixel a 2x2 block); the VAE's 4x latent is 16x16
and the transformer sees 8x8 = 64 image tokens of 64 channels (FLUX's 2x2 packing). diffusers' ``FluxPipeline``
and omni derive the VAE factor from ``block_out_channels`` (2 ** (blocks - 1)), so a three-block VAE is all it
takes. A 9x9 shape spans 4-5 latent pixels a side; with the first model's 8x VAE (8x8 latents, 16 tokens) it
spanned 2, and the VAE's round trip alone read only 74% of shapes back. Images are scored after a 2x2 box
downsample, which returns the 32x32 render exactly. Captions come in every clause order (``phrasings``), so
reordered prompts are in-distribution for diffusers alone, which applies no prompt grammar.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_models.shapes_grammar import COLOR_NAMES, POSITION_NAMES, SHAPE_NAMES
from omni_models.synthetic import clip_tokenizer, t5_tokenizer
from omni_models.training import shapes
from omni_models.training.captions import VOCABULARY, SceneSpec

NAME = "omni-flux-shapes-tiny"
IMAGE_SIZE = 64
UPSCALE = IMAGE_SIZE // shapes.IMAGE_SIZE
VAE_SCALE_FACTOR = 4
LATENT_CHANNELS = 16
LATENT_SIZE = IMAGE_SIZE // VAE_SCALE_FACTOR
IMAGE_TOKENS = (LATENT_SIZE // 2) ** 2
# What diffusers' FluxPipeline and omni's FamilyPipeline feed FLUX.1-dev-style models by default: every prompt is
# padded to 512 T5 tokens (neither passes an attention mask), so the shipped model is trained and judged at 512.
MAX_SEQUENCE_LENGTH = 512
# Every training caption is at most 15 T5 tokens with its EOS. Most training steps pad T5 ids to this length
# instead (a step then costs a fraction of a 512-token one: the pads are most of the transformer's tokens), the
# rest to 512, so the model learns the images from many more samples and still reads 512-token inputs.
SHORT_SEQUENCE_LENGTH = 16
CLIP_LENGTH = 77
# The defaults both pipelines use for a model with embedded guidance (FLUX.1-dev's): training distils guidance
# over a range that holds 3.5, and 28 Euler steps is where adherence is measured.
DEFAULT_STEPS = 28
DEFAULT_GUIDANCE = 3.5
# FLUX.1-dev's scheduler config; mu for the 64 image tokens comes from the same line diffusers computes.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


@dataclass(frozen=True)
class FluxShapesConfig:
    """Sizes of every component. ``attention_head_dim`` must equal ``sum(axes_dims_rope)`` (FLUX's RoPE)."""

    num_layers: int = 2
    num_single_layers: int = 4
    num_attention_heads: int = 8
    attention_head_dim: int = 32
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)
    text_width: int = 64
    text_layers: int = 2
    text_heads: int = 4
    vae_channels: tuple[int, ...] = (32, 64, 64)
    vae_norm_groups: int = 32  # GroupNorm groups; must divide every entry of vae_channels

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim {self.attention_head_dim}"
            )
        if len(self.vae_channels) != int(math.log2(VAE_SCALE_FACTOR)) + 1:
            raise ValueError(
                f"vae_channels needs {int(math.log2(VAE_SCALE_FACTOR)) + 1} blocks for the {VAE_SCALE_FACTOR}x latent"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CONFIGS: dict[str, FluxShapesConfig] = {
    "tiny": FluxShapesConfig(),
    # The --smoke run's: every block kind present, seconds on a CPU.
    "smoke": FluxShapesConfig(
        num_layers=1,
        num_single_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        axes_dims_rope=(4, 6, 6),
        text_width=16,
        text_layers=1,
        text_heads=2,
        vae_channels=(8, 8, 8),
        vae_norm_groups=8,
    ),
}


# --- components --------------------------------------------------------------------------------------------------


def tokenizers() -> tuple[Any, Any]:
    """(CLIP, T5) tokenizers over the shapes vocabulary, as ``from_pretrained`` reads them back.

    Each is saved and reloaded once, so training tokenizes exactly as the shipped files do (transformers rebuilds
    a T5 tokenizer's normalizer and pre-tokenizer on load rather than reading them from ``tokenizer.json``).
    CLIP lower-cases its input; T5 does not, so capitalised words reach T5 as single letters.
    """
    import tempfile

    words = [w for w in VOCABULARY if w.isalpha()] + ["an"]
    loaded = []
    for tokenizer in (clip_tokenizer(words), t5_tokenizer(words)):
        with tempfile.TemporaryDirectory() as directory:
            tokenizer.save_pretrained(directory)
            loaded.append(type(tokenizer).from_pretrained(directory))
    return loaded[0], loaded[1]


def build_components(config: FluxShapesConfig, *, seed: int) -> dict[str, Any]:
    """Freshly initialised ``FluxPipeline`` components (each module initialised by its own library, seeded)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip, t5 = tokenizers()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=config.num_layers,
        num_single_layers=config.num_single_layers,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.text_width,
        pooled_projection_dim=config.text_width,
        guidance_embeds=True,
        axes_dims_rope=config.axes_dims_rope,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(config.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(config.vae_channels),
        block_out_channels=config.vae_channels,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=config.vae_norm_groups,
        sample_size=IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    eos = len(clip) - 1
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip),
            hidden_size=config.text_width,
            intermediate_size=2 * config.text_width,
            num_hidden_layers=config.text_layers,
            num_attention_heads=config.text_heads,
            max_position_embeddings=CLIP_LENGTH,
            bos_token_id=eos - 1,
            eos_token_id=eos,
            pad_token_id=eos,
            projection_dim=config.text_width,
        )
    )
    torch.manual_seed(seed + 3)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5),
            d_model=config.text_width,
            d_kv=config.text_width // config.text_heads,
            d_ff=2 * config.text_width,
            num_layers=config.text_layers,
            num_heads=config.text_heads,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
        )
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "tokenizer": clip,
        "tokenizer_2": t5,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }


# The shipped weights' dtype: half the bytes of fp32 with a 10-bit mantissa (bf16 keeps 7); both pipelines load
# them in whatever dtype they are asked for (fp32 on the CPU).
STORED_DTYPE = torch.float16


def save_pipeline(components: dict[str, Any], directory: Path) -> Path:
    """Write fp16 copies of ``components`` with ``FluxPipeline.save_pretrained`` (shards under 16 MB per file),
    through a sibling directory renamed into place, so a run killed while saving keeps the previous checkpoint."""
    import copy
    import shutil

    from diffusers import FluxPipeline

    stored = {
        k: (copy.deepcopy(v).to("cpu", STORED_DTYPE) if isinstance(v, torch.nn.Module) else v)
        for k, v in components.items()
    }
    staging = directory.with_name(directory.name + ".saving")
    shutil.rmtree(staging, ignore_errors=True)
    FluxPipeline(**stored).save_pretrained(str(staging), max_shard_size="15MB")
    if directory.exists():
        for path in directory.iterdir():  # what the run keeps beside the weights (its logs) stays
            if not (staging / path.name).exists():
                path.rename(staging / path.name)
        shutil.rmtree(directory)
    staging.rename(directory)
    return directory


# --- images ------------------------------------------------------------------------------------------------------


def render(scenes: torch.Tensor, jitter: torch.Tensor | None = None) -> torch.Tensor:
    """``shapes.render`` of int64 [B, 4] scenes at 64x64: float [B, 3, 64, 64] in [-1, 1], each pixel 2x2."""
    small = shapes.render(scenes[:, 0], scenes[:, 1], scenes[:, 2], scenes[:, 3], jitter)
    return small.repeat_interleave(UPSCALE, dim=2).repeat_interleave(UPSCALE, dim=3)


def scorer_images(images: Sequence[Image.Image]) -> np.ndarray:
    """uint8 [N, 32, 32, 3] for ``scorer.read_scenes``: each image box-downsampled to the world's 32x32."""
    size = (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE)
    return np.stack([np.asarray(image.convert("RGB").resize(size, Image.BOX), dtype=np.uint8) for image in images])


# --- captions ----------------------------------------------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# Styles: (clause separator, articles and "on" kept, final punctuation). The first is the canonical caption's.
_STYLES: tuple[tuple[str, bool, str], ...] = ((" ", True, ""), (", ", True, "."), (", ", False, "!"))
# Clause subsets shown in training, with the share of captions each gets (as omni-shapes-tiny's training).
_FORMS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("object", "position", "background"), 0.7),
    (("object", "background"), 0.1),
    (("object", "position"), 0.1),
    (("object",), 0.1),
)
CANONICAL_SHARE = 0.6  # of each form's captions: canonical order and style; the rest spread over the others


def _clauses(scene: SceneSpec, articles: bool) -> dict[str, str]:
    color, background = COLOR_NAMES[scene.color], COLOR_NAMES[scene.background]
    obj = f"{color} {SHAPE_NAMES[scene.shape]}"
    return {
        "object": f"{_article(color)} {obj}" if articles else obj,
        "position": f"at the {POSITION_NAMES[scene.position]}",
        "background": f"on {_article(background)} {background} background" if articles else f"{background} background",
    }


def phrasings(scene: SceneSpec) -> list[tuple[str, float]]:
    """Every caption training shows for ``scene`` with its sampling weight (the weights sum to 1).

    The same list layout for every scene; entry 0 is ``scene.caption()``, the canonical full caption. Each form
    (clause subset) comes in every clause order and every style of ``_STYLES``.
    """
    out: list[tuple[str, float]] = []
    for clauses, share in _FORMS:
        variants = []
        for (separator, articles, end), order in itertools.product(_STYLES, itertools.permutations(clauses)):
            parts = _clauses(scene, articles)
            variants.append(separator.join(parts[c] for c in order) + end)
        rest = (1 - CANONICAL_SHARE) / (len(variants) - 1)
        out += [(text, share * (CANONICAL_SHARE if i == 0 else rest)) for i, text in enumerate(variants)]
    assert out[0][0] == scene.caption()
    return out


# --- flow matching -----------------------------------------------------------------------------------------------


def dynamic_shift_mu(image_seq_len: int = IMAGE_TOKENS) -> float:
    """diffusers' ``calculate_shift`` for this scheduler config: mu on the line through (256, 0.5), (4096, 1.15)."""
    c = SCHEDULER_CONFIG
    slope = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
    return image_seq_len * slope + c["base_shift"] - slope * c["base_image_seq_len"]


def shift_sigmas(sigmas: torch.Tensor, mu: float) -> torch.Tensor:
    """The scheduler's exponential time shift: ``e^mu / (e^mu + 1/sigma - 1)`` (sigma in (0, 1])."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C], FluxPipeline's 2x2 packing."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def latent_image_ids(device: torch.device | str = "cpu") -> torch.Tensor:
    """[tokens, 3] position ids of the packed image tokens: (0, row, column), as FluxPipeline builds them."""
    side = LATENT_SIZE // 2
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return ids.reshape(-1, 3).to(device)
