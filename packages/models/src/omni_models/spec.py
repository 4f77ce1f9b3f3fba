"""What a model is and what it accepts: ``ModelInfo`` (one type for every model kind) and ``ModelSpec``.

``ModelInfo`` is what a loaded pipeline says about itself (``pipeline.info``) and what ``omni_models.inspect``
computes from a model directory's metadata alone; both give the same value. It is a msgspec struct, so the
engine process sends it to the API process as bytes, and the server builds its ``/v1/models`` entry, its request
checks and its playground from it. ``ModelSpec`` adds what a caller needs before loading: the model kind and
what each of omni's libraries may do with it.

Sizes are (height, width) pairs; every message a client reads names them as ``WIDTHxHEIGHT``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Task = Literal["text-to-image", "text-to-video", "text-to-music"]
# What ``guidance_scale`` drives: classifier-free guidance of the model's own rows ("cfg": the shipped DiT), an
# embedded guidance input ("embedded": FLUX.1-dev), or true CFG with a negative prompt ("true-cfg": Qwen-Image,
# FLUX.1-schnell). Each pipeline maps the one request field onto its own mechanism.
GuidanceKind = Literal["cfg", "embedded", "true-cfg"]


class SizeRange(msgspec.Struct, frozen=True, kw_only=True):
    """Height and width each a multiple of ``multiple`` in [``min_side``, ``max_side``]."""

    multiple: int
    min_side: int
    max_side: int


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What an image model accepts. ``sizes``: the listed sizes, the default first; with ``size_range`` any size
    in the range is accepted (``sizes`` then holds the default only)."""

    sizes: tuple[tuple[int, int], ...]
    size_range: SizeRange | None = None
    default_steps: int
    max_inference_steps: int
    guidance: GuidanceKind
    default_guidance_scale: float
    true_cfg: bool = False  # ``true_cfg_scale`` is accepted on top of ``guidance_scale`` (FLUX.1-dev)
    default_true_cfg_scale: float | None = None
    # The negative prompt a request gets when it names none (Qwen-Image: " ", so its default true CFG applies, as
    # diffusers documents); None: no negative prompt (the shipped DiT then guides against the null prompt).
    default_negative_prompt: str | None = None
    max_images_per_request: int
    max_prompt_tokens: int
    # Input images an edit request may carry (``image`` in ``ModelInfo.accepts``); 0: the model does no editing.
    max_input_images: int = 0
    # Input images an edit request must carry (Qwen-Image-Edit: 1; it does no text to image); 0: none needed.
    min_input_images: int = 0

    @property
    def default_size(self) -> tuple[int, int]:
        return self.sizes[0]

    def size_problem(self, height: int, width: int, model: str) -> str | None:
        """Why ``width`` x ``height`` is refused (naming what is accepted), or None."""
        if height < 1 or width < 1:
            return f"size {width}x{height}: width and height must be positive"
        rule = self.size_range
        if rule is None:
            if (height, width) in self.sizes:
                return None
            listed = ", ".join(f"{w}x{h}" for h, w in self.sizes)
            return f"size {width}x{height} is not supported by {model}; supported sizes: {listed}"
        if all(side % rule.multiple == 0 and rule.min_side <= side <= rule.max_side for side in (height, width)):
            return None
        return (
            f"size {width}x{height} is not supported by {model}: width and height must be multiples of "
            f"{rule.multiple} in [{rule.min_side}, {rule.max_side}]"
        )

    def fit_size(self, height: int, width: int) -> tuple[int, int]:
        """An accepted size closest to ``width`` x ``height`` with its aspect ratio (``size=auto`` of an edit): scaled
        down into ``max_side`` if larger, each side rounded to the nearest ``multiple``, then clamped into range. A
        model of listed sizes gets the listed size nearest in aspect ratio, then area."""
        rule = self.size_range
        if rule is None:
            return min(
                self.sizes, key=lambda hw: (abs(hw[1] / hw[0] - width / height), abs(hw[0] * hw[1] - height * width))
            )
        scale = min(1.0, rule.max_side / max(height, width))

        def side(value: int) -> int:
            rounded = int(value * scale / rule.multiple + 0.5) * rule.multiple
            return min(max(rounded, rule.min_side), rule.max_side)

        return side(height), side(width)

    def smallest_listed_size(self) -> tuple[int, int]:
        """The cheapest of ``sizes`` (a size the model serves: the engine's first warm-up request)."""
        return min(self.sizes, key=lambda hw: hw[0] * hw[1])

    def smallest_size(self) -> tuple[int, int]:
        """The cheapest accepted size (an edit-only model's warm-up input image)."""
        if self.size_range is None:
            return self.smallest_listed_size()
        return self.size_range.min_side, self.size_range.min_side

    def largest_size(self) -> tuple[int, int]:
        """The most expensive accepted size (KV pool sizing, memory profiling)."""
        if self.size_range is None:
            return max(self.sizes, key=lambda hw: hw[0] * hw[1])
        return self.size_range.max_side, self.size_range.max_side


class AudioLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a music model produces and accepts: mono or multi-channel PCM, frames at ``frame_rate`` per second."""

    sample_rate: int
    channels: int
    frame_rate: int
    max_frames: int
    max_seed: int


class VideoLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a video model accepts beyond its frames' ``ImageLimits`` (size, steps, guidance, prompt, ``n``).

    ``num_frames`` is ``frame_multiple * k + 1`` (the VAE's temporal factor: Wan's 4k+1) in [1, ``max_num_frames``];
    ``fps`` only labels the output (the model draws the same frames at any rate). ``experts``: the denoising
    transformers (Wan2.2 A14B: 2, switched at ``boundary_ratio`` of the training timesteps); with two,
    ``guidance_scale_2`` is the low-noise expert's guidance (``guidance_scale_2`` in ``ModelInfo.accepts``).
    """

    default_num_frames: int
    max_num_frames: int
    frame_multiple: int
    default_fps: int
    max_fps: int
    experts: int = 1
    boundary_ratio: float | None = None
    # Unset guidance_scale_2 takes guidance_scale when the request gives one (diffusers' rule), else this default.
    default_guidance_scale_2: float | None = None

    def num_frames_problem(self, num_frames: int) -> str | None:
        """Why ``num_frames`` is refused (naming what is accepted), or None."""
        if 1 <= num_frames <= self.max_num_frames and (num_frames - 1) % self.frame_multiple == 0:
            return None
        return (
            f"num_frames must be {self.frame_multiple}k+1 in [1, {self.max_num_frames}] "
            f"(e.g. {self.default_num_frames}), got {num_frames}"
        )


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One model as every layer sees it. ``accepts`` names the request fields the model uses (the others are
    refused by name). By ``task``: an image model sets ``image``; a video model sets ``image`` (each frame's size,
    the steps, guidance and prompt, as an image model) and ``video``; a music model sets ``audio``."""

    name: str  # what was loaded: a shipped name, a directory or a repo id
    family: str  # "omni-dit", "flux", "qwen-image", "omni-music"
    variant: str  # e.g. "omni-shapes-tiny", "flux.1-dev", "flux.1-schnell", "qwen-image", "omni-tones-tiny"
    task: Task
    accepts: tuple[str, ...]
    image: ImageLimits | None = None
    video: VideoLimits | None = None
    audio: AudioLimits | None = None
    # A closed prompt vocabulary (the shipped DiT's words); None: any text.
    vocabulary: tuple[str, ...] | None = None
    # The paged KV path (diffusion_kv rows per CFG row, prefix K/V written once): the shipped DiT family.
    paged_kv: bool = False
    # The transformer's repeated blocks in forward order (what a step cache cuts into first, middle and last
    # blocks, ``omni_models.step_cache``); 0: none (music).
    transformer_blocks: int = 0

    def __post_init__(self) -> None:
        wanted = {"text-to-image": {"image"}, "text-to-video": {"image", "video"}, "text-to-music": {"audio"}}
        given = {name for name in ("image", "video", "audio") if getattr(self, name) is not None}
        if given != wanted[self.task]:
            raise ValueError(f"a {self.task} model sets exactly its {' and '.join(sorted(wanted[self.task]))} limits")


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What omni's libraries may do with a model (checked before loading, so a flag it cannot honour is refused at
    start). ``attention_heads``: the heads sequence parallelism splits (it must divide them)."""

    fp8: bool
    layerwise_offload: bool
    offload_allgather: bool  # its streamed blocks can be sharded over several ranks
    cfg_parallel: bool
    sequence_parallel: bool
    attention_heads: int | None = None
    compile: bool = False  # load(compile=True) compiles it for serving (omni_models.compilation)
    prompt_embed_cache: bool = False  # load(prompt_embed_cache_size=N) caches prompt embeddings
    batched_image_tokens: bool = False  # load(max_batched_image_tokens=N) caps the image tokens of a forward's batch
    lora: bool = False  # serves LoRA adapters per request (``omni_models.lora``)
    fp8_attention: bool = False  # load(attention_dtype="fp8") attends in FP8 (``omni_models.attention``)


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A model directory read without loading it: its kind (the registry entry), where it is, what it accepts."""

    kind: str
    directory: str
    info: ModelInfo
    capabilities: Capabilities


__all__ = [
    "AudioLimits",
    "Capabilities",
    "GuidanceKind",
    "ImageLimits",
    "ModelInfo",
    "ModelSpec",
    "SizeRange",
    "Task",
    "VideoLimits",
]
