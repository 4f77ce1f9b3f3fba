"""The text-to-image pipeline of the causal-prefix DiT family: the stepwise paged contract and ``__call__``.

``Pipeline`` implements ``omni_models.contract.PagedPipeline``: an engine owns the KV pool and the row table,
installs each job's rows and sets ``job.kv_rows``; ``start`` writes a job's prefix K/V once, ``step`` runs one
Euler step of every job in one forward. ``__call__`` is built on the same calls over a private pool sized for
the call, so an engine's pool bound through ``allocate_kv_caches`` is never touched by it. With
``attention_backend="dense"`` it uses the dense reference sampler instead (same images within floating-point
noise). With ``cuda_graphs=True`` (CUDA, paged) each batch layout's denoise forward is captured once and replayed
on later steps (``omni_models.graphs``); a pipeline with layerwise offload must keep it off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch
from PIL import Image

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
from omni_models import paged, parallel
from omni_models.config import DIT_ACCEPTS, DiTConfig, dit_info
from omni_models.errors import InvalidRequestError
from omni_models.flow import euler_times, initial_noise
from omni_models.graphs import StepGraphs
from omni_models.images import to_uint8_images
from omni_models.integrations import declare_kv_cache
from omni_models.model import CausalPrefixDiT
from omni_models.prompts import PromptReader
from omni_models.request import ResolvedRequest, prepare_one_call
from omni_models.runner import GenerationJob, GenerationRow, ScheduledJob, scheduled
from omni_models.sampling import generate_dense
from omni_models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dlo_offload import LayerwiseOffload
    from omni_models.parallel import ParallelState

AttentionBackend = Literal["paged", "dense"]
CALL_BLOCK_SIZE = 16  # block size of the private pool ``__call__`` allocates
_PRIVATE_REQUEST_ID = "private-pool"  # the one request a private pool's row table holds


class Pipeline:
    """A loaded causal-prefix DiT ready to generate. Not thread-safe: one caller drives one pipeline."""

    def __init__(
        self,
        model: CausalPrefixDiT,
        tokenizer: Tokenizer,
        *,
        device: torch.device,
        dtype: torch.dtype,
        name: str | None = None,
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
        self.prompts = PromptReader(tokenizer, prompt_grammar)
        self.device = device
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.info = dit_info(model.config, tokenizer.vocabulary[2:], name or model.config.name)
        declare_kv_cache(model, dtype)
        self.cuda_graphs = cuda_graphs
        # Graphs of steps over the bound pool (``step``); __call__ keeps its own per call.
        self.step_graphs: StepGraphs | None = StepGraphs() if cuda_graphs else None
        self._kv_layers = tuple(discover_kv_cache_specs(model).values())  # block order: layer_index order
        self.kv_caches: list[torch.Tensor] = []
        self._paged_kv: paged.PagedKV | None = None  # the bound caches plus the engine's row table
        # This rank's share of a multi-rank forward (omni_models.parallel.enable_parallel); None: one rank.
        self.parallel: ParallelState | None = None

    @property
    def prompt_grammar(self) -> Callable[[str], str] | None:
        """The grammar prompts go through before tokenizing (``self.prompts.grammar``)."""
        return self.prompts.grammar

    # --- the stepwise contract ----------------------------------------------------------------------------------

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[GenerationJob]:
        """The request's ``n`` jobs (image ``i`` seeded ``seed + i``); rows: cond, then uncond when
        ``guidance_scale != 1``. Tokenizes only; raises InvalidRequestError (``.param`` names the field)."""
        rows_ids = self.prompts.rows(request)
        target_len = self.model.config.num_image_tokens(request.height, request.width)
        rows = tuple(GenerationRow(role, tuple(ids), target_len) for role, ids in rows_ids)
        times = tuple(euler_times(request.num_inference_steps).tolist())
        shape = (self.model.config.in_channels, request.height, request.width)
        if request.cache is not None and self.parallel is not None and self.parallel.sp_size > 1:
            raise InvalidRequestError(
                'the shipped DiT\'s step cache is not available with sequence parallelism yet; use "off"',
                param="cache",
            )
        jobs = []
        for index in range(request.n):
            image = msgspec.structs.replace(request, n=1, seed=request.seed + index)
            job = GenerationJob(
                request=image,
                rows=rows,
                latents=initial_noise(image.seed, shape).to(self.device),
                times=times,
                request_id=request_id,
            )
            if request.cache is not None:
                from omni_models.step_cache_blocks import JobStepCache

                job.step_cache = JobStepCache.create(
                    request.cache, num_blocks=self.model.config.depth, num_steps=job.num_steps, num_rows=len(rows)
                )
            jobs.append(job)
        return jobs

    def step_cache_bytes(self, job: GenerationJob) -> int:
        """The most memory ``job``'s step cache holds (per row: the image tokens' residual, its differences and
        the first blocks' residual); 0 without one."""
        if job.step_cache is None:
            return 0
        from omni_models.step_cache_blocks import JobStepCache

        width = self.model.config.width
        streams = [(row.target_len * width,) for row in job.rows]
        return JobStepCache.bytes_bound(job.step_cache.config, streams, torch.finfo(self.dtype).bits // 8)

    def start(self, jobs: Sequence[GenerationJob]) -> None:
        """Write the prefix K/V of every job among ``jobs`` that has not written it yet (rows installed)."""
        fresh = [job for job in jobs if not job.prefix_written]
        if fresh:
            self._write_prefix(self._bound_kv(), scheduled(fresh))

    def step(self, jobs: Sequence[GenerationJob], *, recompute_prefix: bool = False) -> None:
        """One Euler step for each job, reading cached prefix K/V through the block tables.

        ``recompute_prefix`` runs the prompt tokens through every block again instead (the no-reuse baseline of
        the benchmarks: same images, more work).
        """
        batch = scheduled(jobs)
        if self.parallel is not None:
            if recompute_prefix:
                raise ValueError("recompute_prefix is a single-rank benchmark baseline; run it without parallelism")
            parallel.denoise_step(self.model, self._bound_kv(), batch, self.parallel)
            return
        paged.denoise_step(
            self.model, self._bound_kv(), batch, recompute_prefix=recompute_prefix, graphs=self.step_graphs
        )

    def decode(self, jobs: Sequence[GenerationJob]) -> list[Image.Image]:
        for job in jobs:
            if not job.finished:
                raise ValueError(f"job is at step {job.step_index} of {job.num_steps}; decode needs a finished job")
        return [Image.fromarray(to_uint8_images(job.latents.unsqueeze(0))[0]) for job in jobs]

    def release(self, jobs: Sequence[GenerationJob]) -> None:
        """The engine frees the jobs' blocks; the jobs forget their rows and drop their step caches."""
        for job in jobs:
            job.kv_rows = None
            if job.step_cache is not None:
                job.step_cache.release()

    def close(self) -> None:
        """Nothing outlives the pipeline object (a multi-rank pipeline stops its workers here)."""

    def enable_parallel(self, state: ParallelState) -> None:
        """Run this rank's share of every forward (``omni_models.parallel``; before any KV cache is allocated)."""
        parallel.enable_parallel(self, state)

    # --- the KV pool ----------------------------------------------------------------------------------------------

    def kv_cache_specs(self) -> dict[str, AttentionCacheSpec]:
        """Layer name -> ``diffusion_kv.AttentionCacheSpec`` for every attention layer (all ``PRIMARY_CACHE_ROLE``)."""
        return dict(zip((spec.layer_name for spec in self._kv_layers), self._kv_layers, strict=True))

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
        """Read the rows of ``start``/``step`` from ``table`` (the engine installs and retires them there); it must
        address the bound caches: same block size and device, no more blocks."""
        self._paged_kv = paged.PagedKV(self._kv_layers, tuple(self.kv_caches), table)
        self._forget_graphs()

    def allocate_kv_caches_for(self, jobs: Sequence[GenerationJob], block_size: int) -> None:
        """Allocate and bind a pool holding exactly ``jobs``' rows, with its own row table, and set each job's
        ``kv_rows`` on it (a forward outside an engine's pool, e.g. memory profiling)."""
        kv = self._private_pool(jobs, block_size)
        self.kv_caches, self._paged_kv = list(kv.caches), kv
        self._forget_graphs()

    def _private_pool(self, jobs: Sequence[GenerationJob], block_size: int) -> paged.PagedKV:
        """A pool and row table holding ``jobs``' rows on consecutive blocks, installed as one request."""
        rows = [row for job in jobs for row in job.rows]
        sequences, next_block = [], 0
        for sequence_id, row in enumerate(rows):
            count = cdiv(row.num_tokens, block_size)
            blocks = list(range(next_block, next_block + count))
            sequences.append(
                DiffusionKVSequenceMetadata(sequence_id, row.prefix_len, row.target_len, row.num_tokens, (blocks,))
            )
            next_block += count
        table = WorkerRowTable(
            num_rows=len(rows),
            max_rows_per_request=len(rows),
            num_blocks=next_block,
            block_size=block_size,
            max_model_len=max(row.num_tokens for row in rows),
            registered_roles={PRIMARY_CACHE_ROLE},
            device=self.device,
        )
        table.install(DiffusionKVMetadata(_PRIVATE_REQUEST_ID, 0, tuple(sequences)))
        identities = iter([RowIdentity(_PRIVATE_REQUEST_ID, sequence_id=i) for i in range(len(rows))])
        for job in jobs:
            job.kv_rows = tuple(next(identities) for _ in job.rows)
        return paged.PagedKV(self._kv_layers, tuple(self._new_caches(next_block, block_size)), table)

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

    def _write_prefix(self, kv: paged.PagedKV, batch: Sequence[ScheduledJob]) -> None:
        if self.parallel is not None:
            parallel.write_prefix(self.model, kv, batch, self.parallel)
        else:
            paged.write_prefix(self.model, kv, batch)

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
        jobs = prepare_one_call(
            self,
            prompt,
            negative_prompt,
            seed,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
        )
        if self.attention_backend == "dense":
            return self._generate_dense(jobs, callback_on_step_end)
        return self._generate_paged(jobs, callback_on_step_end)

    def _generate_paged(self, jobs: list[GenerationJob], callback) -> list[Image.Image]:
        kv = self._private_pool(jobs, CALL_BLOCK_SIZE)
        batch = scheduled(jobs)
        self._write_prefix(kv, batch)
        graphs = StepGraphs(max_graphs=1) if self.cuda_graphs else None
        for step in range(jobs[0].num_steps):
            if self.parallel is not None:
                parallel.denoise_step(self.model, kv, batch, self.parallel)
            else:
                paged.denoise_step(self.model, kv, batch, graphs=graphs)
            if callback is not None:
                callback(self, step, jobs[0].times[step], {"latents": torch.stack([job.latents for job in jobs])})
        return self.decode(jobs)

    def _generate_dense(self, jobs: list[GenerationJob], callback) -> list[Image.Image]:
        request = jobs[0].request
        cond = [list(job.rows[0].token_ids) for job in jobs]
        uncond = [list(job.rows[1].token_ids) for job in jobs] if jobs[0].guided else None
        images = generate_dense(
            self.model,
            cond,
            uncond,
            [job.request.seed for job in jobs],
            num_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            height=request.height,
            width=request.width,
        )
        for job, image in zip(jobs, images, strict=True):
            job.latents = image
            job.step_index = job.num_steps
        if callback is not None:
            callback(self, request.num_inference_steps - 1, 0.0, {"latents": images})
        return self.decode(jobs)


def build_model(config: DiTConfig) -> CausalPrefixDiT:
    return CausalPrefixDiT(config)


__all__ = ["CALL_BLOCK_SIZE", "DIT_ACCEPTS", "AttentionBackend", "Pipeline", "build_model", "dit_info"]
