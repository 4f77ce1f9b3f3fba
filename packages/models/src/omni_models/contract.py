"""The stepwise contract every pipeline implements and an engine drives, whatever the model kind.

One request becomes ``n`` jobs (one per image or song); an engine advances the jobs of many requests together:

1. ``jobs = pipeline.prepare(resolved, request_id=...)``: host-side work only (tokenize, initial noise); a bad
   request raises ``InvalidRequestError`` naming the field and nothing changes. ``resolved`` comes from
   ``omni_models.request.resolve_request``; ``prepare`` does not check it again.
2. ``pipeline.start(jobs)`` once per job, before its first step: the per-request work that reads the model
   (the families' text encoders, the shipped DiT's prefix K/V, the music model's AR rows). Jobs may start in any
   grouping; a job that already started is skipped.
3. ``pipeline.step(jobs)`` advances every job by one step. Jobs may come from different requests and be at
   different step indices; a job appears at most once per call and must be started and unfinished.
4. ``pipeline.decode(jobs)``: the outputs of finished jobs, in order (PIL images; ``Song`` for music).
5. ``pipeline.release(jobs)`` when their request ends however it ends (finished, aborted, failed): frees what
   the pipeline holds for them. Calling it for a job twice, or for a job that never started, is allowed.

Paged pipelines (``ModelInfo.paged_kv``: the shipped DiT family) also implement ``PagedPipeline``: the engine
owns the KV pool and the row table; it installs a job's rows, binds their identities to the job
(``job.kv_rows``), and only then starts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from diffusion_kv import AttentionCacheSpec, WorkerRowTable
    from omni_models.request import ResolvedRequest
    from omni_models.spec import ModelInfo


@runtime_checkable
class Job(Protocol):
    """The mutable state of one output being generated."""

    request_id: str | None

    @property
    def step_index(self) -> int: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    @property
    def num_rows(self) -> int:
        """Transformer rows one step of this job runs (CFG: 2), for row budgets and KV reservation."""
        ...


@runtime_checkable
class StepwisePipeline(Protocol):
    """What an engine drives (see the module docstring)."""

    info: ModelInfo
    device: torch.device

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[Any]: ...

    def start(self, jobs: Sequence[Any]) -> None: ...

    def step(self, jobs: Sequence[Any]) -> None: ...

    def decode(self, jobs: Sequence[Any]) -> list[Any]: ...

    def release(self, jobs: Sequence[Any]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class PagedPipeline(StepwisePipeline, Protocol):
    """A pipeline whose rows live in an engine-owned paged KV pool (``diffusion_kv``).

    Each job has ``rows`` (one ``GenerationRow`` per CFG row: ``prefix_len``, ``target_len``, ``num_tokens``) and
    ``kv_rows`` (the ``RowIdentity`` of each row in the bound row table, set by the engine after installing it).
    """

    def kv_cache_specs(self) -> dict[str, AttentionCacheSpec]: ...

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]: ...

    def bind_row_table(self, table: WorkerRowTable) -> None: ...

    def allocate_kv_caches_for(self, jobs: Sequence[Any], block_size: int) -> None:
        """A pool and row table holding exactly ``jobs``' rows, bound, with ``kv_rows`` set on each job (memory
        profiling and one-off runs outside an engine's pool)."""
        ...


__all__ = ["Job", "PagedPipeline", "StepwisePipeline"]
