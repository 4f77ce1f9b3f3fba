"""The engine for real families (FLUX.1, Qwen-Image): step-level batching over ``FamilyPipeline``'s stepwise API.

What ``PagedEngine`` does for the shipped DiT, without a KV pool (the families' joint attention recomputes text
K/V every step, so there is nothing to page). Each iteration:

1. admission: waiting requests join the running set FIFO while fewer than ``max_num_seqs`` requests run;
   a newly admitted request's prompts go through the text encoders once (``encode_prompts``: its cond and,
   under true CFG, its negative prompt, shared by all its ``n`` images);
2. ONE denoising step for every running image, whatever request it belongs to and whatever step it is at:
   ``FamilyPipeline.run_denoise_step`` puts all rows (cond, plus uncond under true CFG) of the images of one
   size into one transformer forward. **Grouping rule: rows share a forward when their images have the same
   height and width** (the same image sequence length and positions); Qwen-Image's text lengths may differ
   within it (ragged rows, masked). Each distinct size in the running set costs one forward per iteration.
   Per-request steps, guidance, true-CFG scale and size are honoured row by row;
3. requests whose images all finished are decoded together (one VAE decode per distinct size) and reported.

Request fields (``GenerationParams``) map onto the family (``family_request_kwargs``):
- ``guidance_scale`` is the family's own guidance: FLUX.1-dev's embedded guidance; for families without it
  (Qwen-Image, FLUX.1-schnell) it is the true-CFG scale (so ``--guidance-scale 4`` means CFG 4 everywhere).
  ``true_cfg_scale`` names true CFG explicitly (FLUX.1-dev: true CFG on top of embedded guidance).
- ``negative_prompt``: when omitted, the family's ``default_negative_prompt`` (Qwen-Image: ``" "``, so its
  default true CFG 4.0 applies, as diffusers' QwenImagePipeline documents); FLUX has none (no true CFG).
- image ``i`` of a request is seeded ``seed + i`` (diffusers' ``torch.Generator("cpu").manual_seed``).

Invariant (as for every engine): each added request produces exactly one ``RequestFinished``; a request that
fails (bad field, text encoder, forward, decode) fails alone and the loop lives on.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_server.config import ServerConfig
from omni_server.schemas import MAX_IMAGES_PER_REQUEST
from omni_server.engine import (
    EngineOutput,
    Timer,
    encode_png,
    fault_injection_hook,
    forward_isolating_failures,
    request_error,
    run_warmup_request,
)
from omni_server.protocol import (
    SEED_DRAW_RANGE,
    EngineReady,
    EngineStats,
    GenerationParams,
    ModelCard,
    RequestError,
    SizeRange,
    StepProgress,
)

logger = logging.getLogger("omni_server.engine")

FAMILY_REQUEST_FIELDS = ["prompt", "negative_prompt", "size", "num_inference_steps", "guidance_scale",
                         "true_cfg_scale", "n", "seed"]


def family_card(info: Any, served_name: str) -> ModelCard:
    """The ``ModelCard`` of a loaded family (``FamilyPipeline.info``)."""
    return ModelCard(
        name=served_name,
        sizes=[(int(info.default_height), int(info.default_width))],
        default_size=(int(info.default_height), int(info.default_width)),
        default_steps=int(info.default_steps),
        default_guidance_scale=(info.default_guidance_scale if info.embedded_guidance
                                else info.default_true_cfg_scale),
        max_prompt_tokens=int(info.max_sequence_length),
        family=info.family,
        variant=info.variant,
        size_range=SizeRange(multiple=int(info.pixel_multiple), min_side=int(info.min_side),
                             max_side=int(info.max_side)),
        accepts=list(FAMILY_REQUEST_FIELDS),
        default_true_cfg_scale=float(info.default_true_cfg_scale),
        default_negative_prompt=info.default_negative_prompt,
        max_images_per_request=min(int(info.max_images_per_request), MAX_IMAGES_PER_REQUEST),
        max_inference_steps=int(info.max_inference_steps),
    )


def family_request_kwargs(info: Any, params: GenerationParams) -> dict[str, Any]:
    """``FamilyPipeline.prepare`` keyword arguments for one request (see the module docstring for the mapping).

    Raises ``InvalidRequestError`` naming ``guidance_scale`` when a family without embedded guidance gets two
    different CFG scales.
    """
    from omni_models import InvalidRequestError

    guidance, true_cfg = params.guidance_scale, params.true_cfg_scale
    if not info.embedded_guidance and guidance is not None:
        if true_cfg is not None and true_cfg != guidance:
            raise InvalidRequestError(
                f"{info.variant} has no embedded guidance, so guidance_scale is its true-CFG scale; got "
                f"guidance_scale={guidance} and true_cfg_scale={true_cfg}: give one of them", param="guidance_scale")
        guidance, true_cfg = None, guidance
    negative = params.negative_prompt if params.negative_prompt is not None else info.default_negative_prompt
    return dict(prompt=params.prompt, negative_prompt=negative, num_inference_steps=params.num_inference_steps,
                guidance_scale=guidance, true_cfg_scale=true_cfg, height=params.height, width=params.width)


@dataclass(eq=False)
class _Request:
    request_id: str
    params: GenerationParams
    jobs: list[Any]
    timer: Timer
    images: list[bytes] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(job.finished for job in self.jobs)


class FamilyEngine:
    """Step-level batching of ``FamilyPipeline`` requests (see the module docstring)."""

    def __init__(self, pipeline: Any, config: ServerConfig) -> None:
        self._pipeline = pipeline
        self._config = config
        self._card = family_card(pipeline.info, config.model_name)
        self._seeds = random.Random(config.seed)
        self._check_fault = fault_injection_hook()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._outputs: list[EngineOutput] = []
        self._step_latencies: list[float] = []
        self._pid = os.getpid()
        if config.warmup:
            self._warm_up()

    @property
    def card(self) -> ModelCard:
        return self._card

    def _warm_up(self) -> None:
        """One real two-step request at the smallest size through every path (encode, step, decode)."""
        side = self._card.size_range.min_side if self._card.size_range else self._card.default_size[0]
        self.add("warmup", GenerationParams(prompt="warm up", num_inference_steps=2, height=side, width=side, seed=0))
        run_warmup_request(self.step)
        self._step_latencies.clear()

    def ready_message(self) -> EngineReady:
        return EngineReady(card=self._card, kv_blocks_total=0, block_size=0, pid=self._pid)

    # -- requests --------------------------------------------------------------------------

    def add(self, request_id: str, params: GenerationParams) -> None:
        timer = Timer()
        try:
            self._check_n(params.n)
            seed = params.seed if params.seed is not None else self._seeds.randrange(SEED_DRAW_RANGE)
            jobs = self._pipeline.prepare(**family_request_kwargs(self._pipeline.info, params), seed=seed,
                                          num_images=params.n, request_id=request_id)
        except Exception as exc:  # a bad request fails alone, before it runs anything
            self._outputs.append(timer.finished(request_id, error=request_error(exc)))
            return
        self._waiting.append(_Request(request_id, params, jobs, timer))

    def _check_n(self, n: int) -> None:
        from omni_models import InvalidRequestError

        limit = self._card.max_images_per_request
        if limit is not None and n > limit:
            raise InvalidRequestError(f"n must be at most {limit} for {self._card.variant}, got {n}", param="n")

    def abort(self, request_id: str) -> None:
        for queue in (self._waiting, self._running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self._outputs.append(request.timer.finished(
                        request_id, error=RequestError(kind="aborted", message="the request was aborted")))
                    return

    def has_work(self) -> bool:
        return bool(self._outputs or self._waiting or self._running)

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        admitted = []
        while self._waiting and len(self._running) + len(admitted) < self._config.max_num_seqs:
            request = self._waiting.popleft()
            request.timer.mark_scheduled()
            admitted.append(request)
        for request in admitted:
            try:
                self._pipeline.encode_prompts(request.jobs)
            except Exception as exc:
                logger.exception("text encoding failed for request %s", request.request_id)
                self._outputs.append(request.timer.finished(request.request_id, error=request_error(exc)))
                continue
            self._running.append(request)
        if self._running:
            started = time.monotonic()
            self._execute(list(self._running))
            self._step_latencies.append(time.monotonic() - started)
            self._complete([r for r in self._running if r.finished])
        outputs, self._outputs = self._outputs, []
        outputs.append(self.stats())
        return outputs

    def _execute(self, running: Sequence[_Request]) -> None:
        """One denoising step for every running request, batched; a failing batch is run again one request at a
        time so only the culprit fails (``forward_isolating_failures``)."""
        forward_isolating_failures(running, self._forward, self._fail)

    def _forward(self, requests: Sequence[_Request]) -> None:
        for request in requests:
            self._check_fault(request.params)
        jobs = [job for request in requests for job in request.jobs if not job.finished]
        if jobs:
            self._pipeline.run_denoise_step(jobs)

    def _complete(self, finished: Sequence[_Request]) -> None:
        """Decode every finished request together (one VAE decode per size); on failure, one at a time."""
        if not finished:
            return
        try:
            images = self._pipeline.decode([job for request in finished for job in request.jobs])
        except Exception as exc:
            if len(finished) == 1:
                self._fail(finished[0], exc)
                return
            for request in finished:
                self._complete([request])
            return
        offset = 0
        for request in finished:
            request.images = [encode_png(image) for image in images[offset: offset + len(request.jobs)]]
            offset += len(request.jobs)
            self._running.remove(request)
            self._outputs.append(request.timer.finished(request.request_id, images=request.images))

    def _fail(self, request: _Request, exc: Exception) -> None:
        logger.error("request %s failed", request.request_id, exc_info=exc)
        if request in self._running:
            self._running.remove(request)
        self._outputs.append(request.timer.finished(request.request_id, error=request_error(exc)))

    def stats(self) -> EngineStats:
        latencies, self._step_latencies = self._step_latencies, []
        return EngineStats(
            running=len(self._running), waiting=len(self._waiting), kv_blocks_used=0, kv_blocks_total=0,
            step_latencies_s=latencies,
            progress=[StepProgress(r.request_id, r.jobs[0].step_index, r.jobs[0].num_steps) for r in self._running],
        )

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()


__all__ = ["FAMILY_REQUEST_FIELDS", "FamilyEngine", "family_card", "family_request_kwargs"]
