"""Paged engine: diffusion_kv admission + batched stepwise execution of ``omni_models`` pipelines.

One public request (``n`` images) becomes ``n`` ``GenerationJob``s whose CFG rows
(cond, then uncond when guided) are the request's ``DiffusionKVRequest``s, with
contiguous ``sequence_id``s in job order. Each iteration:

1. ``scheduler.schedule()`` admits waiting requests FIFO while their rows fit
   the block pool (capacity is backpressure; a request that can never fit
   finishes alone with ``FINISHED_ERROR``); the ``WorkerRowTable`` retires the
   rows of finished requests, then installs the newly admitted ones, whose
   block tables go to the pipeline;
2. newly admitted jobs get their prefix K/V written (``run_prefix``), then
   every running job advances one Euler step in ONE forward
   (``run_denoise_step``), whatever request or step index it is at;
3. requests whose jobs all finished are decoded to PNG and completed;
   ``update_from_output`` frees the blocks of everything that finished
   (completed, aborted, failed) and reports it.

Invariant: the pool is back at its idle free-block count whenever no request
is waiting or running (asserted by the end-to-end tests through /metrics).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diffusion_kv import DiffusionKVRequest, RequestStatus, registered_roles, sequence_request_id
from diffusion_kv.allocator import BlockPoolConfig
from diffusion_kv.manager import DiffusionKVCacheManager
from diffusion_kv.scheduler import DiffusionKVScheduler, NewRequestData
from diffusion_kv.worker import RowIdentity, WorkerRowTable

from omni_server.config import ServerConfig
from omni_server.engine import (
    Timer,
    encode_png,
    fault_injection_hook,
    forward_isolating_failures,
    model_card,
    request_error,
    run_warmup_request,
)
from omni_server.protocol import (
    SEED_DRAW_RANGE,
    EngineOutput,
    EngineReady,
    EngineStats,
    GenerationParams,
    RequestError,
    RequestFinished,
    StepProgress,
)
from omni_server.scheduling_policy import FairAdmission, StepSelection, blocks_for_rows
from omni_server.schemas import MAX_IMAGES_PER_REQUEST

logger = logging.getLogger("omni_server.engine")



@dataclass(eq=False)
class _PublicRequest:
    """Engine-side state of one public request; the scheduler reads ``request_id`` and
    ``diffusion_kv_requests`` (which it takes over on ``add_request``)."""

    request_id: str
    params: GenerationParams
    jobs: list[Any]
    timer: Timer
    diffusion_kv_requests: list[DiffusionKVRequest] | None = None
    scheduled: list[Any] = field(default_factory=list)  # ScheduledJob per job, once admitted
    images: list[bytes] = field(default_factory=list)  # PNG per job, once decoded


@dataclass(frozen=True)
class PoolSizing:
    """How the KV pool was sized (logged at start-up; ``num_blocks`` includes the allocator's null block)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    source: str


class PagedEngine:
    def __init__(self, pipeline: Any, config: ServerConfig, *, requested_memory: int | None = None) -> None:
        """``requested_memory``: the CUDA memory target measured before the model loaded (None on CPU or
        with an explicit ``kv_cache_memory_bytes``)."""
        import torch

        from omni_models import ScheduledJob

        self._pipeline = pipeline
        self._config = config
        self._scheduled_job = ScheduledJob
        self._card = model_card(pipeline, config.model_name)
        self._torch = torch
        self._seeds = random.Random(config.seed)
        self._check_fault = fault_injection_hook()
        self._requests: dict[str, _PublicRequest] = {}
        self._outputs: list[EngineOutput] = []
        self._failed: dict[str, RequestError] = {}
        self._step_latencies: list[float] = []
        self._pid = os.getpid()

        self.sizing = self._size_pool(requested_memory)
        logger.info("KV pool: %s", self.sizing)
        self._kv_caches = pipeline.allocate_kv_caches(self.sizing.num_blocks, self.sizing.block_size)
        max_rows = MAX_IMAGES_PER_REQUEST * 2
        self._manager = DiffusionKVCacheManager(
            BlockPoolConfig(self.sizing.num_blocks, self.sizing.block_size),
            max_model_len=self.sizing.max_model_len,
            scheduler_block_size=self.sizing.block_size,
            hash_block_size=self.sizing.block_size,
            max_rows_per_request=max_rows,
        )
        self._scheduler = DiffusionKVScheduler(self._manager, max_num_seqs=config.max_num_seqs)
        self._admission: FairAdmission[_PublicRequest] = FairAdmission(request_id=lambda r: r.request_id)
        self._selection = StepSelection(config.max_rows_per_step)
        # The block tables of the scheduled rows, on the pipeline's device: its forwards read them from here.
        row_table_type = getattr(pipeline, "row_table_type", WorkerRowTable)  # workers mirror a multi-rank table
        self._rows = row_table_type(
            num_rows=self._scheduler.worker_row_pool_size, max_rows_per_request=max_rows,
            num_blocks=self.sizing.num_blocks, block_size=self.sizing.block_size,
            max_model_len=self.sizing.max_model_len,
            registered_roles=registered_roles(pipeline.kv_cache_specs()), device=self._device(),
        )
        pipeline.bind_row_table(self._rows)
        if config.warmup:
            self._warm_up()

    # -- start-up: envelope, profile, pool sizing, warm-up -------------------------------

    def _any_word(self) -> str:
        """A valid one-word prompt for internal requests (the vocabulary may be closed)."""
        return self._pipeline.info.vocabulary[0]

    def _largest_row_tokens(self) -> int:
        """Longest CFG row any valid request can produce: the longest prompt plus the largest image."""
        info = self._pipeline.info
        largest = max(self._card.sizes, key=lambda hw: hw[0] * hw[1])
        probe = self._pipeline.prepare(self._any_word(), height=largest[0], width=largest[1], seed=0)
        target = probe.rows[0].target_len
        return int(info.max_prompt_tokens) + target

    def _size_pool(self, requested_memory: int | None) -> PoolSizing:
        """KV budget (explicit, profiled on CUDA, or the CPU default) -> pool geometry via diffusion_kv."""
        from diffusion_kv import build_kv_cache_configs
        from diffusion_kv.sizing import kv_cache_bytes_per_block

        config = self._config
        block_size = config.block_size
        specs = self._pipeline.kv_cache_specs()
        bytes_per_block = kv_cache_bytes_per_block(specs, block_size)
        largest_row = self._largest_row_tokens()
        blocks_per_row = math.ceil(largest_row / block_size)
        if config.kv_cache_memory_bytes:
            budget, source = config.kv_cache_memory_bytes, f"--kv-cache-memory-bytes {config.kv_cache_memory_bytes}"
        elif requested_memory is not None:
            budget = self._profiled_budget(requested_memory, bytes_per_block)
            source = f"profiled, --gpu-memory-utilization {config.gpu_memory_utilization}"
        else:
            # No reliable peak-memory probe on CPU: hold max_num_seqs guided single-image requests.
            budget = (config.max_num_seqs * 2 * blocks_per_row + 1) * bytes_per_block
            source = "CPU default: max_num_seqs guided single-image requests"
        # Unset: the model's longest row. -1: that, fitted down to what the pool holds.
        max_model_len = largest_row if config.max_model_len is None else config.max_model_len
        try:
            configs = build_kv_cache_configs([specs], [budget], block_size=block_size, max_model_len=max_model_len,
                                             max_model_len_limit=largest_row)
        except ValueError as exc:
            raise RuntimeError(
                f"cannot size the KV pool from {source}: {exc}; raise --kv-cache-memory-bytes to at least "
                f"{(blocks_per_row + 1) * bytes_per_block} bytes or lower --max-model-len"
            ) from None
        return PoolSizing(configs.num_blocks, block_size, bytes_per_block, configs.max_model_len, source)

    def _device(self) -> Any:
        return self._torch.device(getattr(self._pipeline, "device", "cpu"))

    def _profiled_budget(self, requested_memory: int, bytes_per_block: int) -> int:
        """Run the largest batch the scheduler can form once; the KV pool gets the memory left over.

        That batch is ``max_num_seqs`` requests of ``MAX_IMAGES_PER_REQUEST`` guided images at the largest
        size (the Worker row pool), over a profile pool that holds exactly it. The profile pool is KV, not
        "non-KV" memory, so its bytes are taken out of the measured peak; it is released before the real
        pool is allocated.
        """
        from diffusion_kv.sizing import kv_budget_from_headroom, profile_non_kv_memory

        images = self._config.max_num_seqs * MAX_IMAGES_PER_REQUEST
        height, width = max(self._card.sizes, key=lambda hw: hw[0] * hw[1])
        jobs = [
            self._pipeline.prepare(self._any_word(), height=height, width=width, seed=0,
                                   guidance_scale=max(self._card.default_guidance_scale, 2.0))  # guided: 2 rows
            for _ in range(images)
        ]
        batch = self._pipeline.allocate_kv_caches_for(jobs, self._config.block_size)
        profile_blocks = self._pipeline.kv_caches[0].shape[0]

        def profile_forward() -> None:
            self._pipeline.run_prefix(batch)
            self._pipeline.run_denoise_step(batch)

        non_kv = profile_non_kv_memory(profile_forward, self._device()) - profile_blocks * bytes_per_block
        self._pipeline.allocate_kv_caches(1, self._config.block_size)  # drop the profile pool
        self._torch.cuda.empty_cache()
        return kv_budget_from_headroom(requested_memory=requested_memory, non_kv_memory=non_kv)

    def _warm_up(self) -> None:
        """One real request through every engine path (admit, prefix, step, decode, free)."""
        height, width = self._card.default_size
        self.add("warmup", GenerationParams(prompt=self._any_word(), num_inference_steps=1, height=height, width=width,
                                            seed=0))
        run_warmup_request(self.step)
        self._step_latencies.clear()

    def ready_message(self) -> EngineReady:
        return EngineReady(card=self._card, kv_blocks_total=self._manager.empty_pool_num_free_blocks,
                           block_size=self.sizing.block_size, pid=self._pid)

    # -- requests --------------------------------------------------------------------------

    def add(self, request_id: str, params: GenerationParams) -> None:
        timer = Timer()
        try:
            jobs = self._prepare_jobs(params)
        except Exception as exc:  # a bad request fails alone, before it owns anything
            self._outputs.append(timer.finished(request_id, error=request_error(exc)))
            return
        kv_requests = []
        sequence_id = 0
        for job in jobs:
            job.request_id = request_id
            for row in job.rows:
                kv_requests.append(DiffusionKVRequest(
                    sequence_request_id(request_id, sequence_id), sequence_id=sequence_id,
                    prefix_len=row.prefix_len, target_len=row.target_len, seq_len=row.num_tokens,
                ))
                sequence_id += 1
        request = _PublicRequest(request_id, params, jobs, timer, diffusion_kv_requests=kv_requests)
        self._admission.add(request, blocks_for_rows([r.seq_len for r in kv_requests], self.sizing.block_size))
        self._requests[request_id] = request

    def _prepare_jobs(self, params: GenerationParams) -> list[Any]:
        if params.true_cfg_scale is not None:
            from omni_models import InvalidRequestError

            raise InvalidRequestError(f"true_cfg_scale applies to the real families (FLUX.1, Qwen-Image); "
                                      f"{self._card.name} takes guidance_scale", param="true_cfg_scale")
        base_seed = params.seed if params.seed is not None else self._seeds.randrange(SEED_DRAW_RANGE)
        return [
            self._pipeline.prepare(
                params.prompt, negative_prompt=params.negative_prompt,
                num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                seed=base_seed + index, height=params.height, width=params.width,
            )
            for index in range(params.n)
        ]

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            waiting = self._admission.remove(request_id)
            if waiting is not None:  # never reached the scheduler: it reports the abort like any other
                self._scheduler.add_request(waiting)
            self._scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        # Every known request is waiting, running, or finished and awaiting its report.
        return bool(self._outputs) or bool(self._requests)

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        outputs, self._outputs = self._outputs, []
        self._release_admissible()
        output = self._scheduler.schedule()
        # Retire finished rows before installing new ones: a release and the admission it made room for
        # can arrive in the same output, reusing the same blocks.
        self._rows.remove(output.finished_row_targets)
        for envelope in output.scheduled_new_reqs:
            self._install(envelope)
        running = [self._requests[e.request_id] for e in (*output.scheduled_new_reqs, *output.scheduled_cached_reqs)]
        completed: list[str] = []
        if running:
            started = time.monotonic()
            self._execute(running)
            self._step_latencies.append(time.monotonic() - started)
            completed = self._complete_finished(running)
        for request_id in self._scheduler.update_from_output(output, completed=completed):
            outputs.append(self._report(request_id))
        outputs.append(self.stats())
        return outputs

    def _release_admissible(self) -> None:
        """Hand the scheduler the waiting requests that fit now (``admission.FairAdmission``)."""
        scheduler = self._scheduler
        if not self._admission or scheduler.waiting:
            return
        for request in self._admission.release(
            free_blocks=self._manager.get_num_free_blocks(),
            free_slots=scheduler.max_num_running_reqs - len(scheduler.running),
            pool_blocks=self._manager.empty_pool_num_free_blocks,
        ):
            scheduler.add_request(request)

    def _install(self, envelope: NewRequestData) -> None:
        """Install the request's rows in the row table and bind each job's rows to their block tables."""
        request = self._requests[envelope.request_id]
        request.timer.mark_scheduled()
        self._rows.install(envelope.diffusion_kv_metadata)
        sequence_ids = iter(range(len(envelope.diffusion_kv_metadata.sequences)))
        request.scheduled = [
            self._scheduled_job(job, tuple(
                RowIdentity(request.request_id, sequence_id=next(sequence_ids)) for _row in job.rows
            ))
            for job in request.jobs
        ]

    def _execute(self, running: Sequence[_PublicRequest]) -> None:
        """Prefix for newly admitted jobs, then one denoise step for every running job, batched (a failing batch
        is run again one request at a time: ``forward_isolating_failures``)."""
        forward_isolating_failures(running, self._forward, self._fail_forward)

    def _fail_forward(self, request: _PublicRequest, exc: Exception) -> None:
        logger.error("forward failed for request %s", request.request_id, exc_info=exc)
        self._fail(request.request_id, request_error(exc))

    def _forward(self, requests: Sequence[_PublicRequest]) -> None:
        for request in requests:
            self._check_fault(request.params)
        batch = self._selection.select([s for r in requests for s in r.scheduled if not s.job.finished])
        # --batch-invariant: one job per forward, the shapes a single-image request runs, so the same bits.
        for part in ([[s] for s in batch] if self._config.batch_invariant else [batch] if batch else []):
            fresh = [s for s in part if not s.job.prefix_written]
            if fresh:
                self._pipeline.run_prefix(fresh)
            self._pipeline.run_denoise_step(part)

    def _complete_finished(self, running: Sequence[_PublicRequest]) -> list[str]:
        completed = []
        for request in running:
            if request.request_id in self._failed or not all(job.finished for job in request.jobs):
                continue
            try:
                request.images = [encode_png(self._pipeline.decode(job)) for job in request.jobs]
            except Exception as exc:
                logger.exception("decoding request %s failed", request.request_id)
                self._fail(request.request_id, request_error(exc))
                continue
            completed.append(request.request_id)
        return completed

    def _fail(self, request_id: str, error: RequestError) -> None:
        self._failed[request_id] = error
        self._scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)

    def _report(self, request_id: str) -> RequestFinished:
        state = self._scheduler.pop_request_state(request_id)
        request = self._requests.pop(request_id)
        timer = request.timer
        if state.status == RequestStatus.FINISHED_STOPPED:
            return timer.finished(request_id, images=request.images)
        if state.status == RequestStatus.FINISHED_ABORTED:
            return timer.finished(request_id, error=RequestError(kind="aborted", message="the request was aborted"))
        error = self._failed.pop(request_id, None)
        if error is None:  # the scheduler's own verdict: admission failed (never fits, too long)
            error = RequestError(kind="capacity", message=state.error or "KV admission failed")
        return timer.finished(request_id, error=error)

    def stats(self) -> EngineStats:
        latencies, self._step_latencies = self._step_latencies, []
        total = self._manager.empty_pool_num_free_blocks
        return EngineStats(
            running=len(self._scheduler.running), waiting=len(self._scheduler.waiting) + len(self._admission),
            kv_blocks_used=total - self._manager.get_num_free_blocks(), kv_blocks_total=total,
            step_latencies_s=latencies,
            progress=[StepProgress(r.request_id, r.jobs[0].step_index, r.jobs[0].num_steps)
                      for r in self._requests.values() if r.scheduled and r.jobs],
        )

    def close(self) -> None:
        self._rows.remove(list(self._rows.installed_request_ids))
        self._scheduler.close()
        self._admission.clear()
        self._requests.clear()
        close = getattr(self._pipeline, "close", None)
        if close is not None:  # a multi-rank pipeline stops its worker processes
            close()
