"""How the engine admits requests and what runs in each forward: the one part that differs by model kind.

``EngineCore`` (``omni_server.engine``) drives any ``omni_models.StepwisePipeline`` and asks a strategy three
things each iteration: which requests run now (``schedule``), which of their jobs go into this forward
(``select``), and which requests ended (``finish``). Two strategies:

- ``PagedStrategy`` (``ModelInfo.paged_kv``: the shipped DiT family): each CFG row of each job is a
  ``diffusion_kv`` row. ``DiffusionKVScheduler`` (policy ``"fair"``) admits while the rows fit the block pool and
  frees them when the request ends; the ``WorkerRowTable`` retires finished rows before installing admitted ones,
  whose identities go onto the jobs (``job.kv_rows``). The pool is sized by ``diffusion_kv.size_kv_pool``.
- ``BatchedStrategy`` (every other kind): no KV pool (the families' joint attention recomputes text K/V every
  step); requests run FIFO while fewer than ``max_num_seqs`` run.

Both pick the jobs of one forward with ``StepSelection`` (``--max-rows-per-step``, fewest steps left first), and
both bound the memory step caches hold with ``StepCacheBudget`` (``--step-cache-memory-bytes``): a request's
bound (``pipeline.step_cache_bytes`` of its jobs) is taken when it is admitted (paged: when it is handed to the
KV scheduler) and given back when it ends; a request that does not fit waits, in order, and one that can never
fit fails at once.

Invariant (both): every request handed to ``add`` is returned by ``finish`` exactly once, as ``Ended``, whether
it completed, was aborted, failed, or could never be admitted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from omni_server.config import ServerConfig
from omni_server.protocol import RequestError
from omni_server.scheduling_policy import StepSelection

if TYPE_CHECKING:
    from diffusion_kv import DiffusionKVRequest, KVPoolSizing, SchedulerOutput
    from omni_models import GenerationJob, Job, PagedPipeline, ResolvedRequest, StepwisePipeline
    from omni_server.engine import Timer

logger = logging.getLogger("omni_server.engine")

Outcome = Literal["completed", "aborted", "failed"]


@dataclass(eq=False)
class EngineRequest:
    """Engine-side state of one public request: its jobs (one per image or song) and, once done, its outputs.

    ``diffusion_kv_requests`` (paged only): one row per CFG row of each job, which ``DiffusionKVScheduler`` reads.
    """

    request_id: str
    request: ResolvedRequest
    jobs: list[Job]
    timer: Timer
    outputs: list[bytes] = field(default_factory=list)
    diffusion_kv_requests: list[DiffusionKVRequest] | None = None

    @property
    def finished(self) -> bool:
        return all(job.finished for job in self.jobs)


@dataclass(frozen=True)
class Ended:
    """A request that ended this iteration; ``error`` is set unless it completed."""

    request: EngineRequest
    outcome: Outcome
    error: RequestError | None = None


@dataclass(frozen=True)
class Occupancy:
    running: int
    waiting: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


class StepCacheBudget:
    """The memory the step caches of admitted requests hold, at most ``--step-cache-memory-bytes``."""

    def __init__(self, pipeline: StepwisePipeline, limit: int) -> None:
        self._bytes_of = getattr(pipeline, "step_cache_bytes", None)
        self.limit = limit
        self._held: dict[str, int] = {}

    @property
    def used(self) -> int:
        return sum(self._held.values())

    def need(self, request: EngineRequest) -> int:
        if self._bytes_of is None:
            return 0
        return sum(self._bytes_of(job) for job in request.jobs)

    def never_fits(self, request: EngineRequest) -> RequestError | None:
        need = self.need(request)
        if need <= self.limit:
            return None
        return RequestError(
            kind="capacity",
            message=f"the request's step cache needs {need} bytes, more than --step-cache-memory-bytes {self.limit}; "
            "ask for fewer images, a smaller size or a lower cache.taylor_order",
            param="cache",
        )

    def take(self, request: EngineRequest) -> bool:
        """Hold ``request``'s bound if it fits beside the others; False (nothing held) if not."""
        need = self.need(request)
        if need and self.used + need > self.limit:
            return False
        if need:
            self._held[request.request_id] = need
        return True

    def free(self, request_id: str) -> None:
        self._held.pop(request_id, None)


class BatchedStrategy:
    """FIFO admission while fewer than ``max_num_seqs`` requests run and their step caches fit; no KV pool."""

    block_size = 0

    def __init__(self, pipeline: StepwisePipeline, config: ServerConfig) -> None:
        self.step_cache = StepCacheBudget(pipeline, config.step_cache_memory_bytes)
        self._max_num_seqs = config.max_num_seqs
        self._selection = StepSelection(config.max_rows_per_step)
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._ended: list[Ended] = []

    def add(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def _take(self, request_id: str) -> EngineRequest | None:
        self.step_cache.free(request_id)
        for queue in (self._waiting, self._running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    def abort(self, request_id: str) -> None:
        request = self._take(request_id)
        if request is not None:
            self._ended.append(
                Ended(request, "aborted", RequestError(kind="aborted", message="the request was aborted"))
            )

    def fail(self, request_id: str, error: RequestError) -> None:
        request = self._take(request_id)
        if request is not None:
            self._ended.append(Ended(request, "failed", error))

    def schedule(self) -> list[EngineRequest]:
        while self._waiting and len(self._running) < self._max_num_seqs:
            request = self._waiting[0]
            error = self.step_cache.never_fits(request)
            if error is not None:
                self._waiting.popleft()
                self._ended.append(Ended(request, "failed", error))
                continue
            if not self.step_cache.take(request):
                break  # FIFO: it waits for running requests' caches to be freed
            self._waiting.popleft()
            request.timer.mark_scheduled()
            self._running.append(request)
        return list(self._running)

    def select(self, jobs: Sequence[Job]) -> list[Job]:
        return self._selection.select(jobs)

    def finish(self, completed: Sequence[str]) -> list[Ended]:
        for request_id in completed:
            request = self._take(request_id)
            if request is not None:
                self._ended.append(Ended(request, "completed"))
        ended, self._ended = self._ended, []
        return ended

    def occupancy(self) -> Occupancy:
        return Occupancy(running=len(self._running), waiting=len(self._waiting))

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()


class PagedStrategy:
    """``diffusion_kv`` admission over one block pool (see the module docstring)."""

    def __init__(self, pipeline: PagedPipeline, config: ServerConfig, *, requested_memory: int | None) -> None:
        """``requested_memory``: the CUDA memory target measured before the model loaded (None on CPU or with an
        explicit ``kv_cache_memory_bytes``)."""
        import torch

        from diffusion_kv import registered_roles
        from diffusion_kv.allocator import BlockPoolConfig
        from diffusion_kv.manager import DiffusionKVCacheManager
        from diffusion_kv.scheduler import DiffusionKVScheduler
        from diffusion_kv.worker import WorkerRowTable

        self._pipeline = pipeline
        self._config = config
        self._torch = torch
        self._requests: dict[str, EngineRequest] = {}
        self._failed: dict[str, RequestError] = {}
        self.step_cache = StepCacheBudget(pipeline, config.step_cache_memory_bytes)
        self._held: deque[EngineRequest] = deque()  # waiting for step-cache memory, before the KV scheduler
        self._ended_here: list[Ended] = []  # ended before reaching the KV scheduler
        self._output: SchedulerOutput | None = None  # this iteration's schedule()
        limits = pipeline.info.image
        self._max_rows = limits.max_images_per_request * 2  # every image guided: cond + uncond
        self.sizing = self._size_pool(requested_memory)
        logger.info("KV pool: %s", self.sizing)
        self.block_size = self.sizing.block_size
        pipeline.allocate_kv_caches(self.sizing.num_blocks, self.sizing.block_size)
        self._manager = DiffusionKVCacheManager(
            BlockPoolConfig(self.sizing.num_blocks, self.sizing.block_size),
            max_model_len=self.sizing.max_model_len,
            scheduler_block_size=self.sizing.block_size,
            hash_block_size=self.sizing.block_size,
            max_rows_per_request=self._max_rows,
        )
        self._scheduler = DiffusionKVScheduler(self._manager, max_num_seqs=config.max_num_seqs, policy="fair")
        self._selection = StepSelection(config.max_rows_per_step)
        # The block tables of the scheduled rows, on the pipeline's device: its forwards read them from here. A
        # multi-rank pipeline journals them for its workers (omni_server.workers).
        row_table_type = getattr(pipeline, "row_table_type", WorkerRowTable)
        self._rows = row_table_type(
            num_rows=self._scheduler.worker_row_pool_size,
            max_rows_per_request=self._max_rows,
            num_blocks=self.sizing.num_blocks,
            block_size=self.sizing.block_size,
            max_model_len=self.sizing.max_model_len,
            registered_roles=registered_roles(pipeline.kv_cache_specs()),
            device=pipeline.device,
        )
        pipeline.bind_row_table(self._rows)

    # -- start-up: pool sizing ------------------------------------------------------------------------------------

    def _probe(self, n: int) -> list[GenerationJob]:
        """``n`` guided jobs at the model's largest size and longest prompt (pool sizing and memory profiling)."""
        from omni_models import GenerationRequest, resolve_request

        info = self._pipeline.info
        limits = info.image
        height, width = limits.largest_size()
        word = info.vocabulary[0] if info.vocabulary else "a"
        request = GenerationRequest(
            prompt=word, height=height, width=width, seed=0, n=1, guidance_scale=max(limits.default_guidance_scale, 2.0)
        )  # guided: 2 rows
        resolved = resolve_request(info, request)
        return [job for _ in range(n) for job in self._pipeline.prepare(resolved)]

    def _largest_row_tokens(self) -> int:
        """Longest CFG row any valid request can produce: the longest prompt plus the largest image."""
        return self._pipeline.info.image.max_prompt_tokens + self._probe(1)[0].rows[0].target_len

    def _size_pool(self, requested_memory: int | None) -> KVPoolSizing:
        from diffusion_kv import size_kv_pool

        config = self._config
        try:
            return size_kv_pool(
                self._pipeline.kv_cache_specs(),
                block_size=config.block_size,
                max_row_tokens=self._largest_row_tokens(),
                max_model_len=config.max_model_len,
                kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                requested_memory=requested_memory,
                profile_forward=self._profile_forward,
                device=self._pipeline.device,
                fallback_rows=config.max_num_seqs * 2,  # no profile (CPU): max_num_seqs guided single images
            )
        except ValueError as exc:
            raise RuntimeError(f"{exc} (--kv-cache-memory-bytes, --gpu-memory-utilization, --max-model-len)") from None

    def _profile_forward(self) -> int:
        """The largest batch the scheduler can form (``max_num_seqs`` requests of the most images, guided, at the
        largest size), once, over a pool that holds exactly it; returns that pool's block count after dropping it."""
        jobs = self._probe(self._config.max_num_seqs * (self._max_rows // 2))
        self._pipeline.allocate_kv_caches_for(jobs, self._config.block_size)
        profile_blocks = self._pipeline.kv_caches[0].shape[0]
        self._pipeline.start(jobs)
        self._pipeline.step(jobs)
        self._pipeline.allocate_kv_caches(1, self._config.block_size)  # drop the profile pool
        self._torch.cuda.empty_cache()
        return profile_blocks

    # -- requests -------------------------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        from diffusion_kv import DiffusionKVRequest, sequence_request_id

        kv_requests = []
        for job in request.jobs:
            for row in job.rows:
                sequence_id = len(kv_requests)
                kv_requests.append(
                    DiffusionKVRequest(
                        sequence_request_id(request.request_id, sequence_id),
                        sequence_id=sequence_id,
                        prefix_len=row.prefix_len,
                        target_len=row.target_len,
                        seq_len=row.num_tokens,
                    )
                )
        request.diffusion_kv_requests = kv_requests
        error = self.step_cache.never_fits(request)
        if error is not None:
            self._ended_here.append(Ended(request, "failed", error))
        elif self._held or not self.step_cache.take(request):
            self._held.append(request)
        else:
            self._hand_over(request)

    def _hand_over(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = request
        self._scheduler.add_request(request)

    def _unhold(self, request_id: str, outcome: Outcome, error: RequestError) -> bool:
        for request in self._held:
            if request.request_id == request_id:
                self._held.remove(request)
                self._ended_here.append(Ended(request, outcome, error))
                return True
        return False

    def abort(self, request_id: str) -> None:
        from diffusion_kv import RequestStatus

        if request_id in self._requests:
            self._scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        else:
            self._unhold(request_id, "aborted", RequestError(kind="aborted", message="the request was aborted"))

    def fail(self, request_id: str, error: RequestError) -> None:
        from diffusion_kv import RequestStatus

        if request_id in self._requests:
            self._failed[request_id] = error
            self._scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
        else:
            self._unhold(request_id, "failed", error)

    def schedule(self) -> list[EngineRequest]:
        from diffusion_kv.worker import RowIdentity

        while self._held and self.step_cache.take(self._held[0]):
            self._hand_over(self._held.popleft())
        output = self._output = self._scheduler.schedule()
        # Retire finished rows before installing new ones: a release and the admission it made room for can
        # arrive in the same output, reusing the same blocks.
        self._rows.remove(output.finished_row_targets)
        for envelope in output.scheduled_new_reqs:
            request = self._requests[envelope.request_id]
            request.timer.mark_scheduled()
            self._rows.install(envelope.diffusion_kv_metadata)
            sequence_ids = iter(range(len(envelope.diffusion_kv_metadata.sequences)))
            for job in request.jobs:
                job.kv_rows = tuple(RowIdentity(request.request_id, sequence_id=next(sequence_ids)) for _ in job.rows)
        return [self._requests[e.request_id] for e in (*output.scheduled_new_reqs, *output.scheduled_cached_reqs)]

    def select(self, jobs: Sequence[Job]) -> list[Job]:
        return self._selection.select(jobs)

    def finish(self, completed: Sequence[str]) -> list[Ended]:
        from diffusion_kv import RequestStatus

        ended, self._ended_here = self._ended_here, []
        if self._output is None:
            return ended
        output, self._output = self._output, None
        for request_id in self._scheduler.update_from_output(output, completed=list(completed)):
            state = self._scheduler.pop_request_state(request_id)
            request = self._requests.pop(request_id)
            self.step_cache.free(request_id)
            if state.status == RequestStatus.FINISHED_STOPPED:
                ended.append(Ended(request, "completed"))
            elif state.status == RequestStatus.FINISHED_ABORTED:
                ended.append(Ended(request, "aborted", RequestError(kind="aborted", message="the request was aborted")))
            else:
                error = self._failed.pop(request_id, None)
                if error is None:  # the scheduler's own verdict: admission failed (never fits, too long)
                    error = RequestError(kind="capacity", message=state.error or "KV admission failed")
                ended.append(Ended(request, "failed", error))
        return ended

    def occupancy(self) -> Occupancy:
        total = self._manager.empty_pool_num_free_blocks
        return Occupancy(
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.waiting) + len(self._held),
            kv_blocks_used=total - self._manager.get_num_free_blocks(),
            kv_blocks_total=total,
        )

    def close(self) -> None:
        self._rows.remove(list(self._rows.installed_request_ids))
        self._scheduler.close()
        self._requests.clear()
        self._held.clear()


__all__ = ["BatchedStrategy", "Ended", "EngineRequest", "Occupancy", "PagedStrategy", "StepCacheBudget"]
