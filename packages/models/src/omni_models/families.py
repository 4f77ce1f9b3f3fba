"""Real model families (FLUX.1, Qwen-Image, ...) from diffusers-layout checkpoints: the stepwise, batched pipeline.

``omni_models.load(path_or_repo_id)`` returns a ``FamilyPipeline`` for a diffusers checkpoint of a registered
family (``omni_models.registry``; each family is one module under ``omni_models.backends``). Its one-call form
mirrors diffusers' pipelines::

    images = pipe("a red fox in the snow", negative_prompt=None, num_inference_steps=28, guidance_scale=3.5,
                  true_cfg_scale=1.0, seed=7, height=1024, width=1024, num_images_per_prompt=2)

and the same seed gives the image diffusers draws with ``generator=torch.Generator("cpu").manual_seed(seed)``
(image ``i`` of a prompt uses ``seed + i``; prompt ``j`` of a list starts after prompt ``j - 1``'s images).

``FamilyPipeline`` implements ``omni_models.contract.StepwisePipeline``:

1. ``prepare(resolved)`` returns ``n`` ``FamilyJob``s sharing one ``PromptConditioning`` (the text encoders run
   once for the request); initial latents are drawn here (CPU generator, diffusers' recipe) and placed on the
   device.
2. ``start(jobs)`` runs the text encoders for every conditioning among ``jobs`` not encoded yet, each distinct
   text once.
3. ``step(jobs)`` advances every job by one step: rows (cond, plus uncond under true CFG) of all jobs with the same
   image size go through ONE transformer forward, one forward per distinct size. Jobs may come from different
   requests, be at different step indices and use different guidance.
4. ``decode(jobs)`` returns their images (one VAE decode per distinct size).

Edit families (FLUX.1-Kontext: ``image`` in ``ModelInfo.accepts``) add a ``ReferenceConditioning`` to a request's
jobs: ``prepare`` turns the request's input images into the pixels the VAE reads (host side), ``start`` encodes them
once for the request (shared by its ``n`` jobs, every step and both CFG rows), ``release`` frees the latents. Jobs
whose output size and reference geometry agree share one forward, whichever request they come from; jobs without a
reference (text to image on the same transformer) form their own group, since their sequences are shorter.

LoRA (``pipeline.lora``, an ``omni_models.lora.LoRARuntime`` when loaded with ``lora=LoRAOptions(...)``): a request
names a registered adapter (``lora``) and a ``lora_scale``; its job holds the adapter, and each forward applies
every row's own adapter (a forward holds at most ``max_loras`` distinct adapters; more are split over forwards).

Guidance (``omni_models.request``): ``guidance_scale`` is the model's guidance. For a family with embedded guidance
(FLUX.1-dev) it is the transformer's guidance input and ``true_cfg_scale`` adds classifier-free guidance on top;
for the others (Qwen-Image, FLUX.1-schnell) ``guidance_scale`` is the true-CFG scale. True CFG runs (a cond and an
uncond row per step) when its scale is > 1 and the job has a negative prompt.

This module is pure torch. What is family-specific is a ``DiffusersFamily`` (its components, what omni's libraries
may do with its transformer, its ``ModelInfo``) and a ``DiffusersBackend`` subclass (prompt encoding, the forward,
guidance, the VAE decode), both in the family's module; ``omni_models.diffusers_adapter`` loads them.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec
import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from omni_models.errors import InvalidRequestError
from omni_models.prompt_cache import PromptEmbeddingCache
from omni_models.request import ResolvedRequest, prepare_one_call
from omni_models.spec import ModelInfo

if TYPE_CHECKING:
    from dlo_offload import LayerwiseOffload
    from fp8_cache import QuantizationReport
    from omni_models.compilation import CompileSettings
    from omni_models.lora import LoRAAdapter, LoRARuntime
    from omni_models.parallel import ParallelState
    from omni_models.step_cache_blocks import JobStepCache, TransformerBlockCache

ComponentKind = Literal["model", "tokenizer", "scheduler", "processor"]
FAMILY_ACCEPTS = (
    "prompt",
    "negative_prompt",
    "size",
    "num_inference_steps",
    "guidance_scale",
    "true_cfg_scale",
    "n",
    "seed",
    "cache",
    "lora",
)


# --- what a family declares ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One component of a diffusers pipeline: the library and the classes it may hold."""

    library: str
    classes: tuple[str, ...]
    kind: ComponentKind
    optional: bool = False  # the checkpoint may leave it out (``[null, null]`` in model_index.json)


@dataclass(frozen=True)
class FamilyDeclaration:
    """A family's transformer as omni's libraries see it (paths are its module names).

    ``block_lists`` are the repeated blocks in the order the forward runs them (streamed by layerwise offload,
    compiled one block at a time); ``resident_modules`` every other module holding weights (kept on the device
    under offload); ``fp8_ignore`` the linears kept in high precision under FP8 (fnmatch patterns for
    ``fp8_cache.quantize_model``). ``block_call``: how the forward calls a block, for the step cache
    (``omni_models.step_cache_blocks``): ``"joint"``, with keywords, returning ``(encoder_hidden_states,
    hidden_states)`` (FLUX.1, Qwen-Image: text and image streams); ``"cross"``, positionally ``(hidden_states,
    encoder_hidden_states, temb, rotary_emb)``, returning ``hidden_states`` (Wan: the text is cross-attention keys
    only, one stream).
    """

    block_lists: tuple[str, ...]
    resident_modules: tuple[str, ...]
    fp8_ignore: tuple[str, ...]
    block_call: Literal["joint", "cross"] = "joint"


@dataclass(frozen=True)
class DiffusersFamily:
    """Everything about one diffusers family that is not its backend's math.

    ``info(name, transformer_config, vae_config, max_sequence_length, settings)`` computes the family's
    ``ModelInfo`` from the component configs alone (``omni_models.inspect`` and the loaded pipeline agree by
    construction); ``check_configs(configs, settings)`` returns why the components do not fit (or None), given the
    config of every diffusers model component present (by slot name). ``settings`` are the pipeline's own config
    values in ``model_index.json`` that the family reads (``settings`` names them: Wan's ``boundary_ratio``); any
    other non-component entry there is refused. ``denoisers`` are the slots holding denoising transformers (loaded
    with FP8 and layerwise offload; Wan2.2 A14B has two). ``backend`` names the ``DiffusersBackend`` subclass and
    ``pipeline`` the ``FamilyPipeline`` class (``"module:Class"``; None: ``FamilyPipeline``).
    """

    name: str
    pipeline_class: str
    slots: Mapping[str, Slot]
    declaration: FamilyDeclaration
    backend: str
    info: Callable[[str, Mapping[str, Any], Mapping[str, Any], int | None, Mapping[str, Any]], ModelInfo]
    check_configs: Callable[[Mapping[str, Mapping[str, Any]], Mapping[str, Any]], str | None]
    default_max_sequence_length: Callable[[Mapping[str, Any]], int]
    max_sequence_length_limit: int
    sequence_parallel: bool = False  # Ulysses SP splits its rows' tokens (rows without ragged text)
    ignored: tuple[str, ...] = ()  # optional components the family never uses (e.g. FLUX's IP-adapter encoder)
    settings: tuple[str, ...] = ()
    denoisers: tuple[str, ...] = ("transformer",)
    pipeline: str | None = None
    float32_components: tuple[str, ...] = ()  # loaded in float32 whatever the load dtype (Wan's VAE, as Wan runs it)
    # What load(...) options and omni features the family takes (ModelSpec.capabilities; the rest is refused).
    cfg_parallel: bool = True
    compile: bool = True
    lora: bool = True


def packing_problem(transformer_config: Mapping[str, Any], vae_latent_channels: Any) -> str | None:
    """Why a transformer's 2x2-packed inputs do not fit the VAE's latent channels (every family), or None."""
    in_channels = transformer_config.get("in_channels", 64)
    if in_channels % 4:
        return f"in_channels={in_channels} is not 4 x the latent channels (2x2 packing)"
    if in_channels // 4 != vae_latent_channels:
        return (
            f"in_channels={in_channels} needs a VAE with {in_channels // 4} latent channels, but the VAE has "
            f"{vae_latent_channels}"
        )
    return None


# --- the stepwise state -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextEmbedding:
    """One prompt through the family's text encoders (on the pipeline's device and dtype)."""

    tokens: Tensor  # [L, D]
    pooled: Tensor | None  # [P]: FLUX's CLIP pooled output; None for Qwen-Image


@dataclass(eq=False)
class PromptConditioning:
    """The text side of one request, shared by all its images. ``negative_prompt`` is set only under true CFG."""

    prompt: str
    negative_prompt: str | None
    cond: TextEmbedding | None = None
    uncond: TextEmbedding | None = None

    @property
    def encoded(self) -> bool:
        return self.cond is not None and (self.negative_prompt is None or self.uncond is not None)


@dataclass(eq=False)
class ReferenceConditioning:
    """The input images of one edit request, shared by all its jobs (``omni_models.backends.flux_kontext``,
    ``omni_models.backends.qwen_image_edit``).

    ``pixels`` are the preprocessed images the VAE encodes (each ``[1, 3, H, W]`` or ``[1, 3, 1, H, W]`` in [-1, 1],
    CPU; set by ``prepare``, dropped once encoded); ``latent_shapes`` each image's latent (height, width);
    ``latents`` their packed VAE latents ``[S_ref, C]`` (concatenated) and ``ids`` their position ids (families
    with explicit ids) on the device (set by ``start``, freed by ``release``). ``key`` tells which references can
    share a forward (the same token grids). A family whose text encoder also reads the images (Qwen-Image-Edit's
    vision-language encoder) keeps its host inputs in ``vision_inputs`` and the encoder's image features, computed
    once in ``start`` and read by every prompt of the request (cond and uncond), in ``vision_features``.
    """

    pixels: Sequence[Tensor] | None
    latent_shapes: tuple[tuple[int, int], ...]
    latents: Tensor | None = None
    ids: Tensor | None = None
    vision_inputs: Any = None
    vision_features: Any = None

    @property
    def encoded(self) -> bool:
        return self.latents is not None

    @property
    def conditions_text(self) -> bool:
        """The prompt embeddings depend on the images (encoded with them, never from the prompt cache)."""
        return self.vision_inputs is not None

    @property
    def num_tokens(self) -> int:
        return sum((h // 2) * (w // 2) for h, w in self.latent_shapes)

    @property
    def key(self) -> tuple[tuple[int, int], ...]:
        return self.latent_shapes

    def release(self) -> None:
        self.pixels = self.latents = self.ids = self.vision_inputs = self.vision_features = None


@dataclass(eq=False)
class FamilyJob:
    """The mutable state of one image. Invariant: ``latents`` is the sampler state after ``step_index`` steps.

    ``request`` is this image's own request (``n == 1``, its own seed); ``guidance`` the embedded guidance input
    (None for families without it) and ``true_cfg_scale`` the classifier-free scale, as the family maps them;
    ``lora`` the adapter its rows use (held until ``release``) at ``request.lora_scale``.
    """

    request: ResolvedRequest
    guidance: float | None
    true_cfg_scale: float
    conditioning: PromptConditioning
    latents: Tensor  # packed [image tokens, channels], the pipeline's dtype and device
    sigmas: Tensor  # float32 [num_steps + 1], CPU, the checkpoint scheduler's sigmas (last one 0)
    timesteps: Tensor  # float32 [num_steps], CPU, what the transformer sees (x 1/1000)
    step_index: int = 0
    request_id: str | None = field(default=None)
    reference: ReferenceConditioning | None = None  # an edit's input images, shared by the request's jobs
    step_cache: JobStepCache | None = None  # the request's step cache state (``omni_models.step_cache_blocks``)
    lora: LoRAAdapter | None = None

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def finished(self) -> bool:
        return self.step_index == self.num_steps

    @property
    def guided(self) -> bool:
        """True CFG runs (a cond and an uncond row per step)."""
        return self.conditioning.negative_prompt is not None

    @property
    def forward_rows(self) -> int:
        """Rows this job puts in a transformer forward: 2 under true CFG (cond, uncond), else 1."""
        return 2 if self.guided else 1

    @property
    def num_rows(self) -> int:
        """Rows of a forward's row budget: 2 under true CFG, else 1; an edit row counts as many rows as its
        sequence (output + reference tokens) is a multiple of the output's, rounded up."""
        rows = 2 if self.guided else 1
        if self.reference is None:
            return rows
        output = self.latents.shape[0]
        return rows * -(-(output + self.reference.num_tokens) // output)

    @property
    def size(self) -> tuple[int, int]:
        return self.request.height, self.request.width

    @property
    def batch_key(self) -> tuple[int, int, tuple[tuple[int, int], ...] | None]:
        """Jobs with equal keys share one transformer forward (the same sequence layout)."""
        return self.request.height, self.request.width, None if self.reference is None else self.reference.key


@dataclass(frozen=True)
class DenoiseRow:
    """One transformer row of a batched forward."""

    latents: Tensor  # [S, C]
    text: TextEmbedding
    timestep: Tensor  # 0-dim, in [0, 1000]: float32 (the image families), the scheduler's own (Wan's UniPC: int64)
    guidance: float | None
    reference: ReferenceConditioning | None = None  # encoded; every row of one forward has the same key


class FamilyBackend(Protocol):
    """The family-specific half (a ``DiffusersBackend`` subclass in the family's module)."""

    transformer: nn.Module
    block_lists: tuple[str, ...]
    compiled_vae_modules: tuple[str, ...]

    def describe(self, name: str) -> ModelInfo: ...
    def encoder_settings(self) -> tuple: ...
    def compile_targets(self) -> list[nn.Module]: ...
    def schedule(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]: ...
    def initial_latents(self, seed: int, height: int, width: int) -> Tensor: ...
    def encode(self, prompt: str) -> TextEmbedding: ...
    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor: ...
    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor: ...
    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]: ...


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]`` (2x2 patches, the families' token layout)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of ``pack_latents`` for latent ``height`` x ``width``."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)


class DiffusersBackend:
    """What every diffusers family's backend shares: geometry, the schedule, initial latents, true CFG.

    It holds the diffusers pipeline object (built over the loaded components) and uses its own ``encode_prompt``,
    scheduler config, VAE and ``image_processor``; diffusers itself is imported only where its functions are
    called, so the family modules import without it.
    """

    family: DiffusersFamily
    # omni's attention processor class installed on the denoisers (None: diffusers' own processors stay).
    attention_processor: Any = None
    # Submodules of the VAE that FamilyPipeline.compile compiles (the decoder, where its convolutions and norms pay).
    compiled_vae_modules: tuple[str, ...] = ()

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype, max_sequence_length: int) -> None:
        self.pipeline = pipeline
        self.transformer: nn.Module = pipeline.transformer
        self.device, self.dtype = device, dtype
        self.vae_scale_factor: int = getattr(pipeline, "vae_scale_factor", 0)  # video families set their own
        self.latent_channels: int = self.transformer.config.in_channels // 4
        self.max_sequence_length = max_sequence_length
        self.block_lists = self.family.declaration.block_lists

    def describe(self, name: str) -> ModelInfo:
        return self.family.info(
            name,
            dict(self.transformer.config),
            dict(self.pipeline.vae.config),
            self.max_sequence_length,
            self.settings(),
        )

    def settings(self) -> dict[str, Any]:
        """The pipeline config values the family reads (``DiffusersFamily.settings``)."""
        return {name: self.pipeline.config.get(name) for name in self.family.settings}

    def encoder_settings(self) -> tuple:
        """What besides the text decides ``encode``'s output (the prompt-embedding cache's key)."""
        return (self.family.name, self.max_sequence_length, str(self.dtype), str(self.device))

    def compile_targets(self) -> list[nn.Module]:
        """The modules compiled for serving: every repeated transformer block, then ``compiled_vae_modules``."""
        blocks = [block for path in self.block_lists for block in self.transformer.get_submodule(path)]
        vae = [self.pipeline.vae.get_submodule(path) for path in self.compiled_vae_modules]
        return blocks + vae

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.vae_scale_factor * 2
        return 2 * (height // factor), 2 * (width // factor)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one backend per loaded pipeline
    def schedule(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """(sigmas [n + 1], timesteps [n]) as the diffusers pipeline computes them for this size, float32 on CPU."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        config = self.pipeline.scheduler.config
        scheduler = type(self.pipeline.scheduler).from_config(config)
        latent_h, latent_w = self.latent_size(height, width)
        mu = calculate_shift(
            (latent_h // 2) * (latent_w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = None if self.uses_flow_sigmas(config) else np.linspace(1.0, 1 / num_steps, num_steps)
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(torch.float32), timesteps.to(torch.float32)

    def uses_flow_sigmas(self, scheduler_config: Mapping[str, Any]) -> bool:
        """Whether the scheduler makes its own sigmas (the pipeline then passes none)."""
        return False

    def initial_latents(self, seed: int, height: int, width: int) -> Tensor:
        """diffusers' draw for ``generator=torch.Generator("cpu").manual_seed(seed)``, packed: ``[S, 4C]``."""
        latent_h, latent_w = self.latent_size(height, width)
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn((1, self.latent_channels, latent_h, latent_w), generator=generator, dtype=self.dtype)
        return pack_latents(noise)[0].to(self.device)

    def timesteps(self, rows: Sequence[DenoiseRow]) -> Tensor:
        # diffusers feeds ``t.to(latents.dtype) / 1000``; the same two ops keep bf16 runs identical.
        return torch.stack([row.timestep for row in rows]).to(self.device).to(self.dtype) / 1000

    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        return uncond + scale * (cond - uncond)

    def postprocess(self, image: Tensor) -> list[Image.Image]:
        return self.pipeline.image_processor.postprocess(image, output_type="pil")

    def prepare_reference(self, request: ResolvedRequest) -> ReferenceConditioning | None:
        """The request's input images as the family conditions on them (host side), or None without images.
        Families that edit override it; ``resolve_request`` refuses images for the others (``image`` is not in
        their ``accepts``)."""
        if request.images:
            raise ValueError(f"the {self.family.name} family takes no input images")
        return None

    def encode_reference(self, reference: ReferenceConditioning) -> None:
        """Fill ``reference.latents`` and ``reference.ids`` (the edit families' VAE encode)."""
        raise NotImplementedError(f"the {self.family.name} family takes no input images")

    def encode_with_reference(self, prompt: str, reference: ReferenceConditioning) -> TextEmbedding:
        """A prompt encoded with the request's images (families whose text encoder reads them)."""
        raise NotImplementedError(f"the {self.family.name} family encodes prompts without images")


def euler_step(latents: Tensor, velocity: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """diffusers' flow-matching Euler step with its precision: state in float32, ``dt * v`` in v's dtype."""
    return (latents.to(torch.float32) + (sigma_next - sigma) * velocity).to(velocity.dtype)


class FamilyPipeline:
    """A loaded family checkpoint ready to generate. Not thread-safe: one caller drives one pipeline."""

    def __init__(
        self,
        backend: FamilyBackend,
        *,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        offload: LayerwiseOffload | None = None,
        fp8: QuantizationReport | None = None,
        prompt_embed_cache_size: int = 0,
        max_batched_image_tokens: int = 0,
    ) -> None:
        if max_batched_image_tokens < 0:
            raise ValueError(f"max_batched_image_tokens must be >= 0 (0: no limit), got {max_batched_image_tokens}")
        self.backend = backend
        self.info = backend.describe(name)
        self.device = device
        self.dtype = dtype
        self.offload = offload
        # Every offloaded denoiser's LayerwiseOffload by slot (``offload`` is the ``transformer``'s).
        self.offloads: dict[str, LayerwiseOffload] = {} if offload is None else {"transformer": offload}
        self.fp8 = fp8
        self.prompt_cache: PromptEmbeddingCache[TextEmbedding] = PromptEmbeddingCache(prompt_embed_cache_size)
        self.max_batched_image_tokens = max_batched_image_tokens  # ``forward_parts``; 0: every row in one forward
        self.compiled: CompileSettings | None = None
        self._block_cache: TransformerBlockCache | None = None  # installed by the first step that caches
        self.lora: LoRARuntime | None = None  # set by omni_models.lora_files.enable_family_lora

    @property
    def transformer(self) -> nn.Module:
        return self.backend.transformer

    # --- the stepwise contract ----------------------------------------------------------------------------------

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[FamilyJob]:
        """The request's ``n`` jobs (image ``i`` seeded ``seed + i``) sharing one ``PromptConditioning``; nothing
        runs on the model."""
        limits = self.info.image
        assert limits is not None
        if limits.guidance == "embedded":
            guidance, cfg = request.guidance_scale, request.true_cfg_scale
        else:  # guidance_scale is the true-CFG scale
            guidance, cfg = None, request.guidance_scale
        assert cfg is not None
        guided = request.negative_prompt is not None and cfg > 1.0
        adapter = self._adapter(request.lora)
        conditioning = PromptConditioning(request.prompt, request.negative_prompt if guided else None)
        sigmas, timesteps = self.backend.schedule(request.num_inference_steps, request.height, request.width)
        reference = self.backend.prepare_reference(request)
        request = msgspec.structs.replace(request, images=())  # the pixels live on the reference from here on
        jobs = []
        for index in range(request.n):
            image = msgspec.structs.replace(request, n=1, seed=request.seed + index)
            job = FamilyJob(
                request=image,
                guidance=guidance,
                true_cfg_scale=cfg,
                conditioning=conditioning,
                latents=self.backend.initial_latents(image.seed, image.height, image.width),
                sigmas=sigmas,
                timesteps=timesteps,
                request_id=request_id,
                reference=reference,
                lora=adapter,
            )
            job.step_cache = self._job_step_cache(job)
            jobs.append(job)
        return jobs

    def _job_step_cache(self, job: FamilyJob) -> JobStepCache | None:
        """The job's step cache state, when its request asks for one."""
        if job.request.cache is None:
            return None
        from omni_models.step_cache_blocks import JobStepCache

        return JobStepCache.create(
            job.request.cache,
            num_blocks=self.info.transformer_blocks,
            num_steps=job.num_steps,
            num_rows=job.forward_rows,
        )

    def step_cache_bytes(self, job: FamilyJob) -> int:
        """The most memory ``job``'s step cache holds (per row: the image and text streams' residuals and
        differences, the first blocks' residual); 0 without one."""
        if job.step_cache is None:
            return 0
        from omni_models.step_cache_blocks import JobStepCache

        config = self.transformer.config
        width = config.num_attention_heads * config.attention_head_dim  # both families' stream width
        latent_h, latent_w = self.backend.latent_size(*job.size)
        image_tokens = (latent_h // 2) * (latent_w // 2)
        text_tokens = self.info.image.max_prompt_tokens
        if job.reference is not None:
            image_tokens += job.reference.num_tokens  # an edit row's image stream holds its reference tokens too
        streams = [(image_tokens * width, text_tokens * width)] * job.forward_rows
        return JobStepCache.bytes_bound(job.step_cache.config, streams, torch.finfo(self.dtype).bits // 8)

    def _adapter(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        adapter = None if self.lora is None else self.lora.get(name)
        if adapter is None:
            served = "" if self.lora is None else ", ".join(a.name for a in self.lora.adapters())
            raise InvalidRequestError(
                f"no LoRA adapter named {name!r} is loaded"
                + (f"; loaded: {served}" if served else " (this pipeline serves none)"),
                param="model",
            )
        return adapter

    @torch.no_grad()
    def start(self, jobs: Sequence[FamilyJob]) -> None:
        """Run the text encoders for every not-yet-encoded conditioning among ``jobs``, each distinct text once
        (and not at all for a text still in the prompt-embedding cache), and the VAE for every not-yet-encoded
        reference (once per request)."""
        encoded: dict[str, TextEmbedding] = {}
        settings = self.backend.encoder_settings()

        def encode(text: str) -> TextEmbedding:
            if text not in encoded:
                encoded[text] = self.prompt_cache.get_or_encode(text, settings, self.backend.encode)
            return encoded[text]

        for job in jobs:
            reference = job.reference
            if reference is not None and not reference.encoded:
                self.backend.encode_reference(reference)
            conditioning = job.conditioning
            if conditioning.encoded:
                continue
            if reference is not None and reference.conditions_text:
                # The images are part of the prompt: encoded with them (the image features computed once above).
                conditioning.cond = self.backend.encode_with_reference(conditioning.prompt, reference)
                if conditioning.negative_prompt is not None:
                    conditioning.uncond = self.backend.encode_with_reference(conditioning.negative_prompt, reference)
                continue
            conditioning.cond = encode(conditioning.prompt)
            if conditioning.negative_prompt is not None:
                conditioning.uncond = encode(conditioning.negative_prompt)

    @staticmethod
    def _check_batch(jobs: Sequence[FamilyJob]) -> None:
        if not jobs:
            raise ValueError("the batch is empty")
        seen: set[int] = set()
        for job in jobs:
            if id(job) in seen:
                raise ValueError(f"job {job.request_id or id(job)} appears twice in one batch")
            seen.add(id(job))
            if not job.conditioning.encoded or (job.reference is not None and not job.reference.encoded):
                raise ValueError("start() must run for a job before its first step")
            if job.finished:
                raise ValueError(f"job already ran all {job.num_steps} steps; decode it")

    @torch.no_grad()
    def step(self, jobs: Sequence[FamilyJob]) -> None:
        """One step for every job: one transformer forward per distinct ``batch_key`` (image size and reference
        geometry), all rows with that key in it."""
        self._check_batch(jobs)
        by_key: dict[tuple[int, int, Any], list[FamilyJob]] = defaultdict(list)
        for job in jobs:
            by_key[job.batch_key].append(job)
        for (height, width, _), jobs_of_key in by_key.items():
            for group in self._lora_groups(jobs_of_key):
                for part in self.forward_parts(group):
                    self._step_group(part, height, width)

    def row_tokens(self, job: FamilyJob) -> int:
        """The image tokens one of ``job``'s rows puts through the transformer: its output's and its references'."""
        return job.latents.shape[0] + (0 if job.reference is None else job.reference.num_tokens)

    def forward_parts(self, jobs: Sequence[FamilyJob]) -> list[list[FamilyJob]]:
        """``jobs`` (one forward's worth) cut, in order, into forwards of at most ``max_batched_image_tokens``
        image tokens (``row_tokens`` times the job's rows); the VAE decodes in batches under the same budget
        (``_decode_parts``).

        - A job's rows stay in one forward: its cond and uncond rows are guided, step-cached and adapted together.
        - A job alone over the budget runs alone.

        Why: once one row fills the card (from 1024² on, 4096 tokens a row on FLUX.1 and Qwen-Image), a batched
        forward is no faster than its rows one after another (diffusers' eager FLUX.1 transformer on an H200: 1.02x
        for 4 rows), and under compile it costs a graph of its own (a second compile of every block class during
        warm-up). Served on the H200, 4 FLUX.1 requests at 1024² one row per forward: 0.994x the serial throughput
        (RESULTS.md 2026-12-03e)."""
        budget = self.max_batched_image_tokens
        if not budget or len(jobs) < 2:
            return [list(jobs)]
        parts: list[list[FamilyJob]] = [[]]
        used = 0
        for job in jobs:
            tokens = job.forward_rows * self.row_tokens(job)
            if parts[-1] and used + tokens > budget:
                parts.append([])
                used = 0
            parts[-1].append(job)
            used += tokens
        return parts

    def _lora_groups(self, jobs: list[FamilyJob]) -> list[list[FamilyJob]]:
        """The forwards ``jobs`` take: one without LoRA; with it, at most ``max_loras`` adapters per forward, and one
        job per forward when a step cache is in play (the cache runs its middle blocks on a subset of the rows,
        while the adapter table is per row of the whole forward; one job's rows always decide together)."""
        if self.lora is None:
            return [jobs]
        parts = [[jobs[i] for i in part] for part in self.lora.partition([job.lora for job in jobs])]
        if any(job.step_cache is not None for job in jobs):
            return [[job] for part in parts for job in part]
        return parts

    def _step_group(self, group: Sequence[FamilyJob], height: int, width: int) -> None:
        rows, caches = [], []
        for job in group:
            conditioning, reference = job.conditioning, job.reference
            timestep = job.timesteps[job.step_index]
            rows.append(DenoiseRow(job.latents, conditioning.cond, timestep, job.guidance, reference))
            caches.append((job.step_cache, 0, job.step_index))
            if job.guided:
                rows.append(DenoiseRow(job.latents, conditioning.uncond, timestep, job.guidance, reference))
                caches.append((job.step_cache, 1, job.step_index))
        if self.lora is None:
            output = self._forward(rows, caches, height, width)
        else:
            adapters = [job.lora for job in group for _ in range(job.forward_rows)]
            scales = [job.request.lora_scale for job in group for _ in range(job.forward_rows)]
            with self.lora.rows(adapters, scales):
                output = self._forward(rows, caches, height, width)
        velocities = iter(output)
        for job in group:
            velocity = next(velocities)
            if job.guided:
                velocity = self.backend.guide(velocity, next(velocities), job.true_cfg_scale)
            i = job.step_index
            job.latents = euler_step(job.latents, velocity, job.sigmas[i], job.sigmas[i + 1])
            job.step_index += 1

    def _forward(self, rows: list[DenoiseRow], caches: list, *shape: Any) -> Tensor:
        """The backend's forward of ``rows`` (``backend.forward(rows, *shape)``); rows whose job has a step cache
        skip the middle blocks on the steps their policy caches (``omni_models.step_cache_blocks``)."""
        if all(cache is None for cache, _, _ in caches):
            return self.backend.forward(rows, *shape)
        from omni_models.step_cache_blocks import StepCachePlan, TransformerBlockCache, row_slots

        if self._block_cache is None:
            call = self.backend.family.declaration.block_call
            self._block_cache = TransformerBlockCache(self.transformer, self.backend.block_lists, block_call=call)
        lengths = [row.text.tokens.shape[0] for row in rows]
        plan = StepCachePlan(row_slots(caches), None if len(set(lengths)) == 1 else lengths, self._block_cache)
        forward_with_cache = getattr(self.backend, "forward_with_cache", None)  # several ranks
        if forward_with_cache is not None:
            return forward_with_cache(rows, *shape, plan)
        with plan.forward(range(len(rows))):
            return self.backend.forward(rows, *shape)

    @torch.no_grad()
    def decode(self, jobs: Sequence[FamilyJob]) -> list[Image.Image]:
        """The images of finished jobs, in order; one VAE decode per distinct size."""
        for job in jobs:
            if not job.finished:
                raise ValueError(f"job is at step {job.step_index} of {job.num_steps}; decode needs a finished job")
        by_size: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, job in enumerate(jobs):
            by_size[job.size].append(index)
        images: list[Image.Image | None] = [None] * len(jobs)
        for (height, width), indices in by_size.items():
            for part in self._decode_parts(indices, jobs):
                decoded = self.backend.decode([jobs[i].latents for i in part], height, width)
                for i, image in zip(part, decoded, strict=True):
                    images[i] = image
        return images  # type: ignore[return-value]

    def _decode_parts(self, indices: list[int], jobs: Sequence[FamilyJob]) -> list[list[int]]:
        """``indices`` (jobs of one size) in VAE batches of at most ``max_batched_image_tokens`` output tokens."""
        budget = self.max_batched_image_tokens
        if not budget:
            return [indices]
        per_batch = max(1, budget // jobs[indices[0]].latents.shape[0])
        return [indices[i : i + per_batch] for i in range(0, len(indices), per_batch)]

    def release(self, jobs: Sequence[FamilyJob]) -> None:
        """Drop the jobs' text embeddings and reference latents (shared by the request's jobs), step caches and
        adapters."""
        for job in jobs:
            job.conditioning.cond = job.conditioning.uncond = None
            if job.reference is not None:
                job.reference.release()
            if job.step_cache is not None:
                job.step_cache.release()
            job.lora = None

    def close(self) -> None:
        """Nothing outlives the pipeline object (a multi-rank pipeline stops its workers here)."""

    def enable_parallel(self, state: ParallelState) -> None:
        """Run this rank's share of every transformer forward (``omni_models.family_parallel``)."""
        from omni_models.family_parallel import enable_family_parallel

        enable_family_parallel(self, state)

    # --- one-call generation ------------------------------------------------------------------------------------

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str | None] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        true_cfg_scale: float | None = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = 1,
        image: Image.Image | Sequence[Image.Image] | None = None,
        callback_on_step_end: Callable[[FamilyPipeline, int, Tensor, dict[str, Any]], Any] | None = None,
        lora: str | None = None,
        lora_scale: float | None = None,
    ) -> list[Image.Image]:
        """Images for each prompt, ``num_images_per_prompt`` each, seeds consecutive from ``seed``.

        ``callback_on_step_end(pipeline, step_index, timestep, {"latents": [B, S, C]})`` observes every step.
        ``image``: an edit family's input image(s) (``FluxKontextPipeline``'s ``image``; several are one reference).
        Every prompt is validated before the model runs. ``negative_prompt=None`` means none (diffusers' default),
        not the model's default negative prompt that servers use. ``lora``: a registered adapter's name (see
        ``self.lora``), at ``lora_scale`` (default 1).
        """
        jobs = prepare_one_call(
            self,
            prompt,
            negative_prompt,
            seed,
            n=num_images_per_prompt,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            true_cfg_scale=true_cfg_scale,
            images=_input_images(image),
            lora=lora,
            lora_scale=lora_scale,
        )
        return self._run_one_call(jobs, callback_on_step_end)

    def _run_one_call(self, jobs: list[Any], callback_on_step_end: Callable[..., Any] | None) -> list[Any]:
        """Start, step (calling ``callback_on_step_end`` after each step), decode and release one call's jobs."""
        self.start(jobs)
        for step in range(jobs[0].num_steps):
            self.step(jobs)
            if callback_on_step_end is not None:
                latents = torch.stack([j.latents for j in jobs])
                callback_on_step_end(self, step, jobs[0].timesteps[step], {"latents": latents})
        outputs = self.decode(jobs)
        self.release(jobs)
        return outputs

    # --- options ------------------------------------------------------------------------------------------------

    def compile(self, settings: CompileSettings) -> None:
        """Compile for serving (``omni_models.compilation``): every repeated transformer block and the backend's
        ``compiled_vae_modules``, in place, with symbolic shapes when ``settings.dynamic``.

        Not combinable with layerwise offload, whose hooks move weights between blocks.
        """
        from omni_models.compilation import compile_modules

        if self.offload is not None:
            raise ValueError("compile cannot be combined with layerwise offload")
        compile_modules(self.backend.compile_targets(), settings)
        self.compiled = settings
        if self.lora is not None:
            self.lora.compiled = True

    def compile_transformer(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` each transformer block in place (regional compilation: one graph per block class),
        with ``compile_kwargs`` as given (benchmarks compare exactly diffusers' recipe with it).

        Not combinable with layerwise offload, whose hooks move weights between blocks.
        """
        if self.offload is not None:
            raise ValueError("compile_transformer cannot be combined with layerwise offload")
        if self.lora is not None:
            self.lora.compiled = True
        for path in self.backend.block_lists:
            for block in self.transformer.get_submodule(path):
                block.compile(**compile_kwargs)


def _input_images(image: Image.Image | Sequence[Image.Image] | None) -> tuple[Any, ...]:
    from omni_models.input_images import InputImage

    if image is None:
        return ()
    return tuple(InputImage.from_pil(i) for i in ([image] if isinstance(image, Image.Image) else image))


__all__ = [
    "FAMILY_ACCEPTS",
    "DenoiseRow",
    "DiffusersBackend",
    "DiffusersFamily",
    "FamilyBackend",
    "FamilyDeclaration",
    "FamilyJob",
    "FamilyPipeline",
    "packing_problem",
    "PromptConditioning",
    "ReferenceConditioning",
    "Slot",
    "TextEmbedding",
    "euler_step",
    "pack_latents",
    "unpack_latents",
]
