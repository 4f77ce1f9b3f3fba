"""The causal-prefix DiT's jobs and rows, the paged half of the stepwise contract (``omni_models.contract``).

Lifecycle of one image (one ``GenerationJob``):

1. ``pipeline.prepare(resolved)`` builds one job per image: ``job.rows`` holds one ``GenerationRow`` per CFG row,
   cond first (1 row when ``guidance_scale == 1``, else 2: cond, uncond). Each row is one ``diffusion_kv`` row of
   ``row.num_tokens = prefix_len + target_len`` tokens (a ``DiffusionKVRequest`` with those lengths); positions
   0..prefix_len-1 are the prompt, the image follows.
2. The engine reserves blocks for every row, installs the rows in the ``diffusion_kv.WorkerRowTable`` bound to the
   pipeline (``pipeline.bind_row_table``) and sets ``job.kv_rows``: one ``RowIdentity`` per row, in ``job.rows``
   order.
3. ``pipeline.start(jobs)`` once per job (any number of jobs per call): writes every row's prefix K/V.
4. ``pipeline.step(jobs)`` once per step: one Euler step for every job. Jobs may be at different step indices and
   from different requests; all their rows go through one forward, which rewrites the rows' target K/V slots and
   reads the cached prefix K/V; the rows must stay installed from ``start`` to the last step.
5. ``job.finished`` becomes True after ``job.num_steps`` steps; ``pipeline.decode(jobs)`` returns the images. The
   engine then retires the rows and frees their blocks.

Inside the paged forwards a batch is a sequence of ``ScheduledJob(job, rows)`` (``omni_models.paged``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torch import Tensor

from omni_models.flow import euler_step, guided_velocity

if TYPE_CHECKING:
    from diffusion_kv import RowIdentity
    from omni_models.request import ResolvedRequest
    from omni_models.step_cache_blocks import JobStepCache

RowRole = Literal["cond", "uncond"]


@dataclass(frozen=True)
class GenerationRow:
    """One CFG row: its prompt tokens (BOS first) are the prefix, the image patches the target."""

    role: RowRole
    token_ids: tuple[int, ...]
    target_len: int

    @property
    def prefix_len(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prefix_len + self.target_len


@dataclass(eq=False)
class GenerationJob:
    """The mutable state of one image being generated.

    Invariants: ``0 <= step_index <= num_steps``; ``latents`` (float32 [C, H, W] on the pipeline's device) is the
    Euler state after ``step_index`` steps; denoising requires ``prefix_written``. ``request`` is this image's own
    request (``n == 1``, its own seed).
    """

    request: ResolvedRequest
    rows: tuple[GenerationRow, ...]
    latents: Tensor
    times: tuple[float, ...]  # the sampler's grid, 1.0 down to 0.0, num_steps + 1 entries
    step_index: int = 0
    prefix_written: bool = False
    request_id: str | None = field(default=None)
    kv_rows: tuple[RowIdentity, ...] | None = None  # set by the engine once the rows are installed
    step_cache: JobStepCache | None = None  # the request's step cache state (``omni_models.step_cache_blocks``)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_steps(self) -> int:
        return len(self.times) - 1

    @property
    def finished(self) -> bool:
        return self.step_index == self.num_steps

    @property
    def guided(self) -> bool:
        return len(self.rows) == 2

    def advance(self, row_velocities: Sequence[Tensor]) -> None:
        """One Euler step of the sampler from the velocities predicted for this job's rows (``rows`` order),
        combined by classifier-free guidance when the job is guided."""
        if len(row_velocities) != len(self.rows):
            raise ValueError(f"job has {len(self.rows)} rows but got {len(row_velocities)} velocities")
        if self.finished:
            raise ValueError(f"job already ran all {self.num_steps} steps")
        velocity = guided_velocity(
            row_velocities[0], row_velocities[1] if self.guided else None, self.request.guidance_scale
        )
        self.latents = euler_step(self.latents, velocity, self.times[self.step_index], self.times[self.step_index + 1])
        self.step_index += 1


@dataclass(frozen=True)
class ScheduledJob:
    """A job plus the ``diffusion_kv`` row of each of its rows (``rows[i]`` holds ``job.rows[i]``)."""

    job: GenerationJob
    rows: tuple[RowIdentity, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.job.rows):
            raise ValueError(f"job has {len(self.job.rows)} rows but {len(self.rows)} row identities")


StepBatch = Sequence[ScheduledJob]


def scheduled(jobs: Sequence[GenerationJob]) -> list[ScheduledJob]:
    """The paged forwards' batch of ``jobs``, whose rows must be installed (``job.kv_rows`` set)."""
    batch = []
    for job in jobs:
        if job.kv_rows is None:
            raise ValueError(
                f"job {job.request_id or id(job)} has no installed rows: install them in the row table "
                "and set job.kv_rows first (or use allocate_kv_caches_for)"
            )
        batch.append(ScheduledJob(job, job.kv_rows))
    return batch
