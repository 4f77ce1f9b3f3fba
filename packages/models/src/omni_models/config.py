"""Configurations of the causal-prefix DiT family."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_models.limits import MAX_IMAGES_PER_REQUEST, MAX_INFERENCE_STEPS
from omni_models.spec import ImageLimits, ModelInfo


def check_known_fields(cls: type, data: dict[str, Any]) -> None:
    """Raise ValueError naming every key of ``data`` that is not a field of the dataclass ``cls``, and the known ones.

    For the ``from_dict`` of config dataclasses: a typo in a config.json fails loudly instead of being dropped.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(fields)}")


@dataclass(frozen=True)
class DiTConfig:
    """Shape of a causal-prefix DiT.

    Invariants (checked in ``__post_init__``): ``width`` divides into ``num_heads`` heads of even size; image
    sizes are multiples of ``patch_size``.
    """

    name: str
    width: int
    depth: int
    num_heads: int
    patch_size: int
    vocab_size: int
    max_prompt_tokens: int
    in_channels: int = 3
    mlp_ratio: float = 4.0
    timestep_frequencies: int = 256
    # Generation defaults and the sizes the model was trained for: (height, width) pairs.
    supported_sizes: tuple[tuple[int, int], ...] = ((32, 32),)
    default_steps: int = 20
    default_guidance: float = 4.0

    def __post_init__(self) -> None:
        if self.width % self.num_heads or (self.width // self.num_heads) % 2:
            raise ValueError(f"width {self.width} must split into {self.num_heads} heads of even size")
        for height, width in self.supported_sizes:
            if height % self.patch_size or width % self.patch_size:
                raise ValueError(f"size {height}x{width} is not a multiple of patch_size {self.patch_size}")

    @property
    def head_size(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    def num_image_tokens(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiTConfig:
        check_known_fields(cls, data)
        data = dict(data)
        if "supported_sizes" in data:
            data["supported_sizes"] = tuple(tuple(size) for size in data["supported_sizes"])
        return cls(**data)


def tiny_config(vocab_size: int, max_prompt_tokens: int = 16) -> DiTConfig:
    """The shipped omni-shapes-tiny: ~11M parameters, 32x32 RGB pixels in 4x4 patches (64 image tokens).

    Patch 4 rather than 2 buys about 3.5x the training samples in a fixed GPU budget; flat-coloured shapes
    have little detail below a 4x4 patch, and the per-patch linear decoder still draws sharp edges.
    """
    return DiTConfig(
        name="omni-shapes-tiny",
        width=320,
        depth=6,
        num_heads=5,
        patch_size=4,
        vocab_size=vocab_size,
        max_prompt_tokens=max_prompt_tokens,
    )


def large_config(vocab_size: int = 32768, max_prompt_tokens: int = 512) -> DiTConfig:
    """A ~2B-parameter random-weight member for GPU benchmarks (1024 image tokens at 64x64 pixels, patch 2)."""
    return DiTConfig(
        name="causal-prefix-dit-2b",
        width=2048,
        depth=28,
        num_heads=16,
        patch_size=2,
        vocab_size=vocab_size,
        max_prompt_tokens=max_prompt_tokens,
        supported_sizes=((64, 64),),
        default_steps=30,
    )


DIT_ACCEPTS = ("prompt", "negative_prompt", "size", "num_inference_steps", "guidance_scale", "n", "seed", "cache")


def dit_info(config: DiTConfig, vocabulary: Sequence[str], name: str) -> ModelInfo:
    """The ``ModelInfo`` of a causal-prefix DiT, from its config and vocabulary alone (``vocabulary`` without the
    padding and BOS tokens)."""
    return ModelInfo(
        name=name,
        family="omni-dit",
        variant=config.name,
        task="text-to-image",
        accepts=DIT_ACCEPTS,
        image=ImageLimits(
            sizes=config.supported_sizes,
            default_steps=config.default_steps,
            max_inference_steps=MAX_INFERENCE_STEPS,
            guidance="cfg",
            default_guidance_scale=float(config.default_guidance),
            max_images_per_request=MAX_IMAGES_PER_REQUEST,
            max_prompt_tokens=config.max_prompt_tokens,
        ),
        vocabulary=tuple(vocabulary),
        paged_kv=True,
        transformer_blocks=config.depth,
    )
