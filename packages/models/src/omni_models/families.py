"""Real model families (FLUX.1, Qwen-Image) from diffusers-layout checkpoints: the stepwise, batched pipeline.

``omni_models.load(path_or_repo_id)`` returns a ``FamilyPipeline`` for a diffusers checkpoint of a supported
family. Its one-call form mirrors diffusers' pipelines::

    images = pipe("a red fox in the snow", negative_prompt=None, num_inference_steps=28, guidance_scale=3.5,
                  true_cfg_scale=1.0, seed=7, height=1024, width=1024, num_images_per_prompt=2)

and the same seed gives the image diffusers draws with ``generator=torch.Generator("cpu").manual_seed(seed)``
(image ``i`` of a prompt uses ``seed + i``; prompt ``j`` of a list starts after prompt ``j - 1``'s images).

Stepwise contract (what an engine drives; ``__call__`` is built on it):

1. ``jobs = pipe.prepare(prompt, ..., num_images=n, request_id=...)`` validates one request (``InvalidRequestError``
   with ``.param`` naming the field; nothing changes on bad input) and returns ``n`` ``FamilyJob``s, image ``i``
   seeded ``seed + i``. They share one ``PromptConditioning``: the text encoders run once for the request.
   Initial latents are drawn here (CPU generator, diffusers' recipe) and placed on the device.
2. ``pipe.encode_prompts(jobs)`` runs the text encoders for every conditioning among ``jobs`` that is not encoded
   yet, each distinct text once. Call it for newly admitted jobs; it is a no-op for encoded ones.
3. ``pipe.run_denoise_step(jobs)`` advances every job by one step. Jobs may come from different requests, be at
   different step indices and use different guidance; rows (cond, plus uncond under true CFG) of all jobs with
   the same image size go through ONE transformer forward, one forward per distinct size. A job appears at most
   once per call; it must be encoded and unfinished.
4. ``job.finished`` after ``job.num_steps`` steps; ``pipe.decode(jobs)`` returns their images (one VAE decode per
   distinct size).

``FamilyInfo`` (``pipe.info``) says what a server may accept: sizes (``pixel_multiple`` steps from ``min_side``
to ``max_side``), defaults, and which of negative prompt / true CFG / embedded guidance apply.

Guidance, as in diffusers: ``guidance_scale`` is FLUX.1-dev's *embedded* guidance (a model input, no extra row);
it is refused by families without it. ``true_cfg_scale`` is classifier-free guidance with a negative prompt: it
applies when ``true_cfg_scale > 1`` AND a negative prompt is given (then each image runs a cond and an uncond
row); otherwise one row.

This module is pure torch: the family-specific work (diffusers' classes, prompt encoding, the schedule, VAE)
is the ``FamilyBackend`` from ``omni_models.diffusers_adapter``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from PIL import Image
from torch import Tensor, nn

from omni_models.errors import InvalidRequestError
from omni_models.limits import check_prompt, check_prompt_batch, check_scale, check_seed, check_steps

if TYPE_CHECKING:
    from dlo_offload import LayerwiseOffload
    from fp8_cache import QuantizationReport

FamilyName = Literal["flux", "qwen-image"]
MAX_IMAGES_PER_REQUEST = 16


@dataclass(frozen=True)
class FamilyInfo:
    """What a loaded family accepts (sizes in pixels; ``height`` and ``width`` alike)."""

    name: str                       # what was loaded (path or repo id)
    family: FamilyName
    variant: str                    # "flux.1-dev" (embedded guidance), "flux.1-schnell" (none), "qwen-image"
    pixel_multiple: int             # height and width must be multiples of this (VAE factor x patch 2)
    min_side: int
    max_side: int
    default_height: int
    default_width: int
    default_steps: int
    max_inference_steps: int
    max_images_per_request: int
    max_sequence_length: int        # prompt tokens the text encoder reads (longer prompts are truncated)
    negative_prompt: bool           # a negative prompt is accepted (it is the uncond row of true CFG)
    true_cfg: bool                  # true_cfg_scale applies (with a negative prompt)
    default_true_cfg_scale: float
    embedded_guidance: bool         # guidance_scale applies (an input of the model, no extra row)
    default_guidance_scale: float | None
    # What a server uses when a request gives no negative prompt (None: no true CFG without one). Qwen-Image's
    # default true_cfg_scale 4.0 only applies with a negative prompt, so servers default it to " " (what diffusers'
    # QwenImagePipeline documents for CFG without a negative). The pipeline's own ``__call__``/``prepare`` keep
    # diffusers' default (None), so a direct call and diffusers' call stay the same call.
    default_negative_prompt: str | None = None


@dataclass(frozen=True)
class TextEmbedding:
    """One prompt through the family's text encoders (on the pipeline's device and dtype)."""

    tokens: Tensor            # [L, D]
    pooled: Tensor | None     # [P]: FLUX's CLIP pooled output; None for Qwen-Image


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


@dataclass(frozen=True)
class FamilyRequest:
    """A validated request for one image: every field concrete (defaults and the random seed chosen)."""

    prompt: str
    negative_prompt: str | None
    num_inference_steps: int
    guidance_scale: float | None      # embedded guidance; None for families without it
    true_cfg_scale: float
    seed: int
    height: int
    width: int

    @property
    def guided(self) -> bool:
        """True CFG runs (a cond and an uncond row per step)."""
        return self.negative_prompt is not None and self.true_cfg_scale > 1.0


@dataclass(eq=False)
class FamilyJob:
    """The mutable state of one image. Invariant: ``latents`` is the sampler state after ``step_index`` steps."""

    request: FamilyRequest
    conditioning: PromptConditioning
    latents: Tensor           # packed [image tokens, channels], the pipeline's dtype and device
    sigmas: Tensor            # float32 [num_steps + 1], CPU, the checkpoint scheduler's sigmas (last one 0)
    timesteps: Tensor         # float32 [num_steps], CPU, what the transformer sees (x 1/1000)
    step_index: int = 0
    request_id: str | None = field(default=None)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def finished(self) -> bool:
        return self.step_index == self.num_steps

    @property
    def guided(self) -> bool:
        return self.request.guided

    @property
    def size(self) -> tuple[int, int]:
        return self.request.height, self.request.width


@dataclass(frozen=True)
class DenoiseRow:
    """One transformer row of a batched forward."""

    latents: Tensor           # [S, C]
    text: TextEmbedding
    timestep: Tensor          # float32 0-dim, in [0, 1000]
    guidance: float | None


class FamilyBackend(Protocol):
    """The family-specific half (implemented in ``omni_models.diffusers_adapter``)."""

    transformer: nn.Module
    block_lists: tuple[str, ...]

    def describe(self, name: str) -> FamilyInfo: ...
    def schedule(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]: ...
    def initial_latents(self, seed: int, height: int, width: int) -> Tensor: ...
    def encode(self, prompt: str) -> TextEmbedding: ...
    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor: ...
    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor: ...
    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]: ...


def check_num_images(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_IMAGES_PER_REQUEST:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_IMAGES_PER_REQUEST}], got {value!r}", param="n")
    return value


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
    ) -> None:
        self.backend = backend
        self.info = backend.describe(name)
        self.device = device
        self.dtype = dtype
        self.offload = offload
        self.fp8 = fp8

    @property
    def transformer(self) -> nn.Module:
        return self.backend.transformer

    # --- request validation -------------------------------------------------------------------------------------

    def _check_size(self, value: Any, param: str) -> int:
        info = self.info
        if isinstance(value, bool) or not isinstance(value, int) or value % info.pixel_multiple \
                or not info.min_side <= value <= info.max_side:
            raise InvalidRequestError(
                f"{param} must be a multiple of {info.pixel_multiple} in [{info.min_side}, {info.max_side}] for "
                f"{info.variant}, got {value!r}",
                param=param,
            )
        return value

    def _request(
        self, prompt: Any, negative_prompt: Any, num_inference_steps: Any, guidance_scale: Any, true_cfg_scale: Any,
        seed: int, height: Any, width: Any,
    ) -> FamilyRequest:
        info = self.info
        check_prompt(prompt)
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise InvalidRequestError(
                f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}",
                param="negative_prompt",
            )
        steps = check_steps(info.default_steps if num_inference_steps is None else num_inference_steps)
        if info.embedded_guidance:
            guidance = check_scale(info.default_guidance_scale if guidance_scale is None else guidance_scale,
                                   "guidance_scale")
        elif guidance_scale is not None:
            raise InvalidRequestError(
                f"{info.variant} has no embedded guidance; guidance_scale must be omitted (use true_cfg_scale with a "
                "negative_prompt for classifier-free guidance)",
                param="guidance_scale",
            )
        else:
            guidance = None
        cfg = check_scale(info.default_true_cfg_scale if true_cfg_scale is None else true_cfg_scale, "true_cfg_scale")
        return FamilyRequest(
            prompt=prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
            true_cfg_scale=cfg, seed=seed,
            height=self._check_size(info.default_height if height is None else height, "height"),
            width=self._check_size(info.default_width if width is None else width, "width"),
        )

    # --- stepwise API -------------------------------------------------------------------------------------------

    def prepare(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        true_cfg_scale: float | None = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images: int = 1,
        request_id: str | None = None,
    ) -> list[FamilyJob]:
        """Validate one request and build its ``num_images`` jobs (image ``i`` uses ``seed + i``), sharing one
        ``PromptConditioning``. Raises InvalidRequestError (``.param`` names the field); nothing runs on the model.
        """
        check_num_images(num_images)
        seed = random.SystemRandom().randrange(2**31) if seed is None else check_seed(seed, reserve=num_images - 1)
        base = self._request(prompt, negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed,
                             height, width)
        conditioning = PromptConditioning(base.prompt, base.negative_prompt if base.guided else None)
        sigmas, timesteps = self.backend.schedule(base.num_inference_steps, base.height, base.width)
        jobs = []
        for index in range(num_images):
            request = dataclasses.replace(base, seed=base.seed + index)
            jobs.append(FamilyJob(
                request=request, conditioning=conditioning,
                latents=self.backend.initial_latents(request.seed, request.height, request.width),
                sigmas=sigmas, timesteps=timesteps, request_id=request_id,
            ))
        return jobs

    @torch.no_grad()
    def encode_prompts(self, jobs: Sequence[FamilyJob]) -> None:
        """Run the text encoders for every not-yet-encoded conditioning among ``jobs``, each distinct text once."""
        encoded: dict[str, TextEmbedding] = {}

        def encode(text: str) -> TextEmbedding:
            if text not in encoded:
                encoded[text] = self.backend.encode(text)
            return encoded[text]

        for job in jobs:
            conditioning = job.conditioning
            if conditioning.encoded:
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
            if not job.conditioning.encoded:
                raise ValueError("encode_prompts must run for a job before its first denoise step")
            if job.finished:
                raise ValueError(f"job already ran all {job.num_steps} steps; decode it")

    @torch.no_grad()
    def run_denoise_step(self, jobs: Sequence[FamilyJob]) -> None:
        """One step for every job: one transformer forward per distinct image size, all rows of that size in it."""
        self._check_batch(jobs)
        by_size: dict[tuple[int, int], list[FamilyJob]] = defaultdict(list)
        for job in jobs:
            by_size[job.size].append(job)
        for (height, width), group in by_size.items():
            rows = []
            for job in group:
                conditioning, request = job.conditioning, job.request
                timestep = job.timesteps[job.step_index]
                rows.append(DenoiseRow(job.latents, conditioning.cond, timestep, request.guidance_scale))
                if job.guided:
                    rows.append(DenoiseRow(job.latents, conditioning.uncond, timestep, request.guidance_scale))
            velocities = iter(self.backend.forward(rows, height, width))
            for job in group:
                velocity = next(velocities)
                if job.guided:
                    velocity = self.backend.guide(velocity, next(velocities), job.request.true_cfg_scale)
                i = job.step_index
                job.latents = euler_step(job.latents, velocity, job.sigmas[i], job.sigmas[i + 1])
                job.step_index += 1

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
            decoded = self.backend.decode([jobs[i].latents for i in indices], height, width)
            for i, image in zip(indices, decoded):
                images[i] = image
        return images  # type: ignore[return-value]

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
        callback_on_step_end: Callable[[FamilyPipeline, int, Tensor, dict[str, Any]], Any] | None = None,
    ) -> list[Image.Image]:
        """Images for each prompt, ``num_images_per_prompt`` each, seeds consecutive from ``seed``.

        ``callback_on_step_end(pipeline, step_index, timestep, {"latents": [B, S, C]})`` observes every step.
        Every prompt is validated before the model runs.
        """
        prompts, negatives = check_prompt_batch(prompt, negative_prompt)
        check_num_images(num_images_per_prompt)
        total = len(prompts) * num_images_per_prompt
        seed = random.SystemRandom().randrange(2**31) if seed is None else check_seed(seed, reserve=total - 1)
        jobs = [
            job
            for index, (text, negative) in enumerate(zip(prompts, negatives))
            for job in self.prepare(text, negative, num_inference_steps, guidance_scale, true_cfg_scale,
                                    seed + index * num_images_per_prompt, height, width, num_images_per_prompt)
        ]
        self.encode_prompts(jobs)
        for step in range(jobs[0].num_steps):
            self.run_denoise_step(jobs)
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, jobs[0].timesteps[step], {"latents": torch.stack([j.latents for j in jobs])})
        return self.decode(jobs)

    # --- options ------------------------------------------------------------------------------------------------

    def compile_transformer(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` each transformer block in place (regional compilation: one graph per block class).

        Not combinable with layerwise offload, whose hooks move weights between blocks.
        """
        if self.offload is not None:
            raise ValueError("compile_transformer cannot be combined with layerwise offload")
        for path in self.backend.block_lists:
            for block in self.transformer.get_submodule(path):
                block.compile(**compile_kwargs)


__all__ = ["DenoiseRow", "FamilyBackend", "FamilyInfo", "FamilyJob", "FamilyName", "FamilyPipeline",
           "FamilyRequest", "PromptConditioning", "TextEmbedding", "check_num_images", "euler_step"]
