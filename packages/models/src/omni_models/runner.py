"""The stepwise, batched, paged generation API's data types (engines that own the KV pool build against these).

Lifecycle of one image (one ``GenerationJob``):

1. ``job = pipeline.prepare(prompt, ...)`` validates the request and builds the job: ``job.rows`` holds one
   ``GenerationRow`` per CFG row, cond first (1 row when ``guidance_scale == 1``, else 2: cond, uncond). Each
   row needs ``row.num_tokens = prefix_len + target_len`` KV slots in the paged pool (a ``DiffusionKVRequest``
   with those lengths).
2. The engine reserves blocks for every row and passes them in a ``ScheduledJob(job, block_tables)``, one block
   id list per row in ``job.rows`` order, each covering at least ``row.num_tokens`` slots
   (``ceil(num_tokens / block_size)`` blocks). Slot of token position p = ``table[p // block_size] *
   block_size + p % block_size``; positions 0..prefix_len-1 are the prompt, the image follows.
3. ``pipeline.run_prefix(batch)`` once per job (any number of jobs per call): writes every row's prefix K/V.
4. ``pipeline.run_denoise_step(batch)`` once per step: one Euler step for every job in the batch. Jobs may be
   at different step indices and from different requests; all their rows go through one forward. Each call
   rewrites the rows' target K/V slots and reads the cached prefix K/V; the block tables must stay the same
   from ``run_prefix`` to the last step.
5. ``job.finished`` becomes True after ``job.num_steps`` steps; ``pipeline.decode(job)`` returns the image.
   The engine then frees the rows' blocks.

A batch is any ``Sequence[ScheduledJob]``; a job appears at most once per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

RowRole = Literal["cond", "uncond"]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: every field is concrete (defaults and the random seed already chosen)."""

    prompt: str
    negative_prompt: str | None
    num_inference_steps: int
    guidance_scale: float
    seed: int
    height: int
    width: int


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
    Euler state after ``step_index`` steps; denoising requires ``prefix_written``.
    """

    request: GenerationRequest
    rows: tuple[GenerationRow, ...]
    latents: Tensor
    times: tuple[float, ...]  # the sampler's grid, 1.0 down to 0.0, num_steps + 1 entries
    step_index: int = 0
    prefix_written: bool = False
    request_id: str | None = field(default=None)

    @property
    def num_steps(self) -> int:
        return len(self.times) - 1

    @property
    def finished(self) -> bool:
        return self.step_index == self.num_steps

    @property
    def guided(self) -> bool:
        return len(self.rows) == 2


@dataclass(frozen=True)
class ScheduledJob:
    """A job plus the block table of each of its rows (``block_tables[i]`` belongs to ``job.rows[i]``)."""

    job: GenerationJob
    block_tables: tuple[Sequence[int], ...]


StepBatch = Sequence[ScheduledJob]
