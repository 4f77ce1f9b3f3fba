"""The text-to-image pipeline of the causal-prefix DiT family: validation, the stepwise paged API, ``__call__``.

``__call__`` is built on the stepwise API (``prepare`` -> ``run_prefix`` -> ``run_denoise_step``* ->
``decode``) over a private KV pool sized for the call, so an engine's pool bound through
``allocate_kv_caches`` is never touched by it. With ``attention_backend="dense"`` it uses the dense reference
sampler instead (same images within floating-point noise). With ``cuda_graphs=True`` (CUDA, paged) each batch
layout's denoise forward is captured once and replayed on later steps (``omni_models.graphs``); a pipeline with
layerwise offload must keep it off.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from diffusion_kv import (
    PRIMARY_CACHE_ROLE,
    AttentionCacheSpec,
    DiffusionKVMetadata,
    DiffusionKVSequenceMetadata,
    RowIdentity,
    WorkerRowTable,
    allocate_kv_caches,
    cdiv,
    discover_kv_cache_specs,
)
from PIL import Image

from omni_models import paged, parallel, shapes_grammar
from omni_models.checkpoint import load_config, load_weights_into
from omni_models.config import DiTConfig
from omni_models.errors import InvalidRequestError
from omni_models.flow import euler_times, initial_noise
from omni_models.graphs import StepGraphs
from omni_models.hub import is_diffusers_checkpoint, resolve_model_dir
from omni_models.images import to_uint8_images
from omni_models.integrations import declare_kv_cache
from omni_models.limits import MAX_GUIDANCE_SCALE, MAX_INFERENCE_STEPS, MAX_SEED, check_prompt_batch
from omni_models.model import CausalPrefixDiT
from omni_models.runner import GenerationJob, GenerationRequest, GenerationRow, ScheduledJob, StepBatch
from omni_models.sampling import generate_dense
from omni_models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dlo_offload import LayerwiseOffload

    from omni_models.families import FamilyPipeline
    from omni_models.parallel import ParallelState

AttentionBackend = Literal["paged", "dense"]
CALL_BLOCK_SIZE = 16  # block size of the private pool ``__call__`` allocates
_PRIVATE_REQUEST_ID = "private-pool"  # the one request a private pool's row table holds


@dataclass(frozen=True)
class PipelineInfo:
    name: str
    supported_sizes: tuple[tuple[int, int], ...]  # (height, width)
    default_steps: int
    default_guidance: float
    max_inference_steps: int
    max_prompt_tokens: int  # including BOS, so max_prompt_tokens - 1 words
    vocabulary: tuple[str, ...]


class Pipeline:
    """A loaded model ready to generate. Not thread-safe: one caller drives one pipeline."""

    def __init__(
        self,
        model: CausalPrefixDiT,
        tokenizer: Tokenizer,
        *,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: AttentionBackend = "paged",
        cuda_graphs: bool = False,
        offload: LayerwiseOffload | None = None,
        prompt_grammar: Callable[[str], str] | Literal["auto"] | None = "auto",
    ) -> None:
        """``device`` is where latents, KV caches and compute live; with layerwise offload (``offload``, the handle
        ``dlo_offload.enable_layerwise_offload`` returned, kept here so its streams and host buffers live as long as
        the pipeline) the blocks' weights stay in host memory and stream to ``device``. ``prompt_grammar`` rewrites
        (or refuses, with ``InvalidRequestError``) a prompt before tokenizing; ``"auto"`` is
        ``shapes_grammar.canonicalize`` when the tokenizer's vocabulary is the shapes world's, else none."""
        if attention_backend not in ("paged", "dense"):
            raise ValueError(f"attention_backend must be 'paged' or 'dense', got {attention_backend!r}")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if offload is not None and cuda_graphs:
            raise ValueError("cuda_graphs cannot be combined with layerwise offload (its hooks move weights)")
        self.model = model.eval()
        self.offload = offload
        self.tokenizer = tokenizer
        if prompt_grammar == "auto":
            prompt_grammar = (shapes_grammar.canonicalize if shapes_grammar.is_shapes_vocabulary(tokenizer.vocabulary[2:])
                              else None)
        self.prompt_grammar: Callable[[str], str] | None = prompt_grammar
        self.device = device
        self.dtype = dtype
        self.attention_backend = attention_backend
        config = model.config
        self.info = PipelineInfo(
            name=config.name,
            supported_sizes=config.supported_sizes,
            default_steps=config.default_steps,
            default_guidance=config.default_guidance,
            max_inference_steps=MAX_INFERENCE_STEPS,
            max_prompt_tokens=tokenizer.max_tokens,
            vocabulary=tokenizer.vocabulary[2:],
        )
        declare_kv_cache(model, dtype)
        self.cuda_graphs = cuda_graphs
        # Graphs of steps over the bound pool (run_denoise_step); __call__ keeps its own per call.
        self.step_graphs: StepGraphs | None = StepGraphs() if cuda_graphs else None
        self._kv_layers = tuple(discover_kv_cache_specs(model).values())  # block order: layer_index order
        self.kv_caches: list[torch.Tensor] = []
        self._paged_kv: paged.PagedKV | None = None  # the bound caches plus the engine's row table
        # This rank's share of a multi-rank forward (omni_models.parallel.enable_parallel); None: one rank.
        self.parallel: ParallelState | None = None

    # --- request validation -------------------------------------------------------------------------------------

    def _validate(
        self, prompt: Any, negative_prompt: Any, num_inference_steps: Any, guidance_scale: Any, seed: Any,
        height: Any, width: Any,
    ) -> tuple[GenerationRequest, list[int], list[int] | None]:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError(f"prompt must be a non-empty string, got {prompt!r}", param="prompt")
        cond_ids = self.tokenizer.encode(prompt if self.prompt_grammar is None else self.prompt_grammar(prompt),
                                         param="prompt")
        if len(cond_ids) == 1:  # BOS alone is the unconditional prompt: it would draw a random scene
            raise InvalidRequestError(f"prompt has no words (only punctuation or spaces): {prompt[:40]!r}",
                                      param="prompt")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise InvalidRequestError(
                f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}",
                param="negative_prompt",
            )
        steps = self.info.default_steps if num_inference_steps is None else num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_INFERENCE_STEPS:
            raise InvalidRequestError(
                f"num_inference_steps must be an integer in [1, {MAX_INFERENCE_STEPS}], got {steps!r}",
                param="num_inference_steps",
            )
        guidance = self.info.default_guidance if guidance_scale is None else guidance_scale
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
                or not 0.0 <= guidance <= MAX_GUIDANCE_SCALE:
            raise InvalidRequestError(
                f"guidance_scale must be a finite number in [0, {MAX_GUIDANCE_SCALE:g}], got {guidance!r}",
                param="guidance_scale",
            )
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}", param="seed")
        default_height, default_width = self.info.supported_sizes[0]
        size = (default_height if height is None else height, default_width if width is None else width)
        if size not in self.info.supported_sizes:
            supported = ", ".join(f"{h}x{w}" for h, w in self.info.supported_sizes)
            raise InvalidRequestError(
                f"size {size[0]!r}x{size[1]!r} (height x width) is not supported by {self.info.name}; "
                f"supported: {supported}",
                param="size",
            )
        guided = float(guidance) != 1.0
        uncond_ids = None
        if guided:
            uncond_ids = (self.tokenizer.null_ids if negative_prompt is None
                          else self.tokenizer.encode(negative_prompt, param="negative_prompt"))
        request = GenerationRequest(
            prompt=prompt, negative_prompt=negative_prompt, num_inference_steps=steps,
            guidance_scale=float(guidance), seed=seed, height=size[0], width=size[1],
        )
        return request, cond_ids, uncond_ids

    # --- stepwise paged API -------------------------------------------------------------------------------------

    def prepare(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        request_id: str | None = None,
    ) -> GenerationJob:
        """Validate one request and build its job (rows: cond, then uncond when guidance_scale != 1).

        Raises InvalidRequestError (``.param`` names the field) and changes nothing on bad input.
        """
        request, cond_ids, uncond_ids = self._validate(
            prompt, negative_prompt, num_inference_steps, guidance_scale, seed, height, width
        )
        target_len = self.model.config.num_image_tokens(request.height, request.width)
        rows = [GenerationRow("cond", tuple(cond_ids), target_len)]
        if uncond_ids is not None:
            rows.append(GenerationRow("uncond", tuple(uncond_ids), target_len))
        latents = initial_noise(request.seed, (self.model.config.in_channels, request.height, request.width))
        return GenerationJob(
            request=request,
            rows=tuple(rows),
            latents=latents.to(self.device),
            times=tuple(euler_times(request.num_inference_steps).tolist()),
            request_id=request_id,
        )

    def kv_cache_specs(self) -> dict[str, AttentionCacheSpec]:
        """Layer name -> ``diffusion_kv.AttentionCacheSpec`` for every attention layer (all ``PRIMARY_CACHE_ROLE``)."""
        return dict(zip((spec.layer_name for spec in self._kv_layers), self._kv_layers))

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """Allocate and bind one paged cache per layer, ``[num_blocks, 2, block_size, heads, head_size]``.

        A row table bound before describes the old pool and is unbound: bind the new pool's with
        ``bind_row_table``.
        """
        self.kv_caches = self._new_caches(num_blocks, block_size)
        self._paged_kv = None
        self._forget_graphs()
        return self.kv_caches

    def _new_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return list(allocate_kv_caches(self.kv_cache_specs(), num_blocks, block_size, device=self.device).values())

    def bind_row_table(self, table: WorkerRowTable) -> None:
        """Read the rows of ``run_prefix``/``run_denoise_step`` batches from ``table`` (the engine installs and
        retires them there); it must address the bound caches: same block size and device, no more blocks."""
        self._paged_kv = paged.PagedKV(self._kv_layers, tuple(self.kv_caches), table)
        self._forget_graphs()

    def allocate_kv_caches_for(self, jobs: Sequence[GenerationJob], block_size: int) -> list[ScheduledJob]:
        """Allocate and bind a pool holding exactly ``jobs``' rows, with its own row table, and return the jobs
        scheduled on it (for a forward outside an engine's pool, e.g. memory profiling)."""
        kv, batch = self._private_pool(jobs, block_size)
        self.kv_caches, self._paged_kv = list(kv.caches), kv
        self._forget_graphs()
        return batch

    def _private_pool(self, jobs: Sequence[GenerationJob], block_size: int) -> tuple[paged.PagedKV, list[ScheduledJob]]:
        """A pool and row table holding ``jobs``' rows on consecutive blocks, installed as one request."""
        rows = [row for job in jobs for row in job.rows]
        sequences, next_block = [], 0
        for sequence_id, row in enumerate(rows):
            count = cdiv(row.num_tokens, block_size)
            blocks = list(range(next_block, next_block + count))
            sequences.append(DiffusionKVSequenceMetadata(sequence_id, row.prefix_len, row.target_len, row.num_tokens,
                                                         (blocks,)))
            next_block += count
        table = WorkerRowTable(
            num_rows=len(rows), max_rows_per_request=len(rows), num_blocks=next_block, block_size=block_size,
            max_model_len=max(row.num_tokens for row in rows), registered_roles={PRIMARY_CACHE_ROLE},
            device=self.device,
        )
        table.install(DiffusionKVMetadata(_PRIVATE_REQUEST_ID, 0, tuple(sequences)))
        identities = iter([RowIdentity(_PRIVATE_REQUEST_ID, sequence_id=i) for i in range(len(rows))])
        batch = [ScheduledJob(job, tuple(next(identities) for _ in job.rows)) for job in jobs]
        return paged.PagedKV(self._kv_layers, tuple(self._new_caches(next_block, block_size)), table), batch

    def _forget_graphs(self) -> None:
        """Captured steps read the previously bound pool: drop them (and the memory they hold)."""
        if self.step_graphs is not None:
            self.step_graphs.clear()

    def _bound_kv(self) -> paged.PagedKV:
        if self._paged_kv is None:
            raise ValueError(
                "no KV pool is bound: call allocate_kv_caches(num_blocks, block_size) and then bind_row_table(table)"
            )
        return self._paged_kv

    def run_prefix(self, batch: StepBatch) -> None:
        """Write every row's prefix K/V into its blocks of the bound caches (once per job)."""
        self._write_prefix(self._bound_kv(), batch)

    def run_denoise_step(self, batch: StepBatch, *, recompute_prefix: bool = False) -> None:
        """One Euler step for each job in the batch, reading cached prefix K/V through the block tables.

        ``recompute_prefix`` runs the prompt tokens through every block again instead (the no-reuse baseline of
        the benchmarks: same images, more work).
        """
        if self.parallel is not None:
            if recompute_prefix:
                raise ValueError("recompute_prefix is a single-rank benchmark baseline; run it without parallelism")
            parallel.denoise_step(self.model, self._bound_kv(), batch, self.parallel)
            return
        paged.denoise_step(self.model, self._bound_kv(), batch, recompute_prefix=recompute_prefix,
                           graphs=self.step_graphs)

    def _write_prefix(self, kv: paged.PagedKV, batch: StepBatch) -> None:
        if self.parallel is not None:
            parallel.write_prefix(self.model, kv, batch, self.parallel)
        else:
            paged.write_prefix(self.model, kv, batch)

    def decode(self, job: GenerationJob) -> Image.Image:
        if not job.finished:
            raise ValueError(f"job is at step {job.step_index} of {job.num_steps}; decode needs a finished job")
        return Image.fromarray(to_uint8_images(job.latents.unsqueeze(0))[0])

    # --- one-call generation ------------------------------------------------------------------------------------

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str | None] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        callback_on_step_end: Callable[[Pipeline, int, float, dict[str, Any]], Any] | None = None,
    ) -> list[Image.Image]:
        """Generate one image per prompt. Prompt i uses seed ``seed + i`` (so a batch equals single calls).

        ``callback_on_step_end(pipeline, step_index, timestep, {"latents": [B, C, H, W]})`` is called after
        every step, for observation. Every prompt is validated before any work starts.
        """
        prompts, negatives = check_prompt_batch(prompt, negative_prompt)
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED - len(prompts):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63 - 1 - batch], got {seed!r}",
                                      param="seed")
        jobs = [
            self.prepare(p, n, num_inference_steps, guidance_scale, seed + i, height, width)
            for i, (p, n) in enumerate(zip(prompts, negatives))
        ]
        if self.attention_backend == "dense":
            return self._generate_dense(jobs, callback_on_step_end)
        return self._generate_paged(jobs, callback_on_step_end)

    def _generate_paged(self, jobs: list[GenerationJob], callback) -> list[Image.Image]:
        kv, batch = self._private_pool(jobs, CALL_BLOCK_SIZE)
        self._write_prefix(kv, batch)
        graphs = StepGraphs(max_graphs=1) if self.cuda_graphs else None
        for step in range(jobs[0].num_steps):
            if self.parallel is not None:
                parallel.denoise_step(self.model, kv, batch, self.parallel)
            else:
                paged.denoise_step(self.model, kv, batch, graphs=graphs)
            if callback is not None:
                callback(self, step, jobs[0].times[step], {"latents": torch.stack([job.latents for job in jobs])})
        return [self.decode(job) for job in jobs]

    def _generate_dense(self, jobs: list[GenerationJob], callback) -> list[Image.Image]:
        request = jobs[0].request
        cond = [list(job.rows[0].token_ids) for job in jobs]
        uncond = [list(job.rows[1].token_ids) for job in jobs] if jobs[0].guided else None
        images = generate_dense(
            self.model, cond, uncond, [job.request.seed for job in jobs], num_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale, height=request.height, width=request.width,
        )
        for job, image in zip(jobs, images):
            job.latents = image
            job.step_index = job.num_steps
        if callback is not None:
            callback(self, request.num_inference_steps - 1, 0.0, {"latents": images})
        return [self.decode(job) for job in jobs]


def load(
    name_or_path: str = "omni-shapes-tiny",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: AttentionBackend | None = None,
    cuda_graphs: bool = False,
    allow_download: bool = False,
    quantization: Literal["fp8"] | None = None,
    fp8_cache_dir: str | Path | None = None,
    layerwise_offload: bool = False,
    offload_resident_blocks: int = 0,
    max_sequence_length: int | None = None,
) -> Pipeline | FamilyPipeline:
    """Load a pipeline by shipped name, local directory or Hugging Face repo id (from the local cache only, unless
    ``allow_download``).

    An omni model directory (``config.json``) gives a ``Pipeline``; a diffusers pipeline checkpoint
    (``model_index.json``) of a supported family gives a ``FamilyPipeline`` (see ``omni_models.families``; it needs
    the ``diffusers`` extra). ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.

    ``attention_backend`` ("paged", the default, or "dense") and ``cuda_graphs`` (replay each batch layout's
    denoise forward as a CUDA graph after its first step; CUDA only, not with layerwise offload) apply to omni
    models only. ``quantization``,
    ``fp8_cache_dir``, ``layerwise_offload``, ``offload_resident_blocks`` and ``max_sequence_length`` apply to the
    families (``omni_models.diffusers_adapter.load_family_pipeline``); for omni models, the server's loader applies
    FP8 and offload. A bad checkpoint raises ``CheckpointError`` before anything is placed on ``device``.
    """
    directory = resolve_model_dir(name_or_path, allow_download=allow_download)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    family_options = {"quantization": quantization, "fp8_cache_dir": fp8_cache_dir,
                      "layerwise_offload": layerwise_offload, "offload_resident_blocks": offload_resident_blocks,
                      "max_sequence_length": max_sequence_length}
    if is_diffusers_checkpoint(directory):
        if attention_backend is not None or cuda_graphs:
            raise ValueError("attention_backend and cuda_graphs apply to omni models; the diffusers families use "
                             "omni's dense attention (omni_models.attention) and compile_transformer()")
        from omni_models.diffusers_adapter import load_family_pipeline

        return load_family_pipeline(directory, name=name_or_path, device=device, dtype=dtype, **family_options)
    defaults = {"quantization": None, "fp8_cache_dir": None, "layerwise_offload": False, "offload_resident_blocks": 0,
                "max_sequence_length": None}
    given = [option for option, value in family_options.items() if value != defaults[option]]
    if given:
        raise ValueError(f"{', '.join(given)} apply to diffusers checkpoints; {name_or_path!r} is an omni model "
                         "(omni_server's loader applies FP8 and offload to it)")
    config, vocabulary = load_config(directory)
    # Build on the meta device and adopt the loaded tensors: no random init of weights about to be replaced.
    with torch.device("meta"):
        model = build_model(config)
    load_weights_into(model, directory, name=config.name)
    model.to(device=device, dtype=dtype)
    return Pipeline(model, Tokenizer(vocabulary, max_tokens=config.max_prompt_tokens), device=device, dtype=dtype,
                    attention_backend=attention_backend or "paged", cuda_graphs=cuda_graphs)


def build_model(config: DiTConfig) -> CausalPrefixDiT:
    return CausalPrefixDiT(config)
