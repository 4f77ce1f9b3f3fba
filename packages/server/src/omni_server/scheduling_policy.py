"""Rows per forward of the engine (``StepSelection``): which admitted jobs advance in each forward.

Which waiting requests are admitted is diffusion_kv's scheduler policy (``DiffusionKVScheduler(policy="fair")``):
a request that fits now may overtake one that must wait, a bounded number of times.

Admitted, a 2-step request still waits one forward per step, and a forward that carries the 20 rows of a
guided ``n=10`` request costs about ten times a forward of its 2 rows. With ``max_rows_per_step`` set, each
forward carries at most that many CFG rows (always at least one job): jobs with the fewest steps left go
first (a short request finishes in a few small forwards), ties go to the job skipped longest (long jobs take
turns), and a job skipped ``MAX_SKIPPED_ROUNDS`` times as many consecutive forwards as one round over all
running rows takes (``ceil(rows / max_rows_per_step)``) goes before everything: no job starves. Jobs of one request
may then sit at different step indices, which the engine's forwards already allow. When every running row
fits the budget, every job advances in every forward, as without the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from diffusion_kv import cdiv

if TYPE_CHECKING:
    from omni_models import Job

MAX_SKIPPED_ROUNDS = 2


class StepSelection:
    """Chooses the jobs of one forward under a row budget (``max_rows`` 0: every job, every forward)."""

    def __init__(self, max_rows: int, *, max_skipped_rounds: int = MAX_SKIPPED_ROUNDS) -> None:
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (0: no limit), got {max_rows}")
        self._max_rows = max_rows
        self._max_skipped_rounds = max_skipped_rounds
        self._skipped: dict[int, int] = {}  # id(job) -> consecutive forwards it was left out of

    def select(self, jobs: Sequence[Job]) -> list[Job]:
        """The unfinished ``jobs`` of one forward (each with ``num_rows``, ``num_steps``, ``step_index``), in the
        given order."""
        total_rows = sum(job.num_rows for job in jobs)
        if not self._max_rows or total_rows <= self._max_rows:
            self._skipped.clear()
            return list(jobs)
        skipped = {id(job): self._skipped.get(id(job), 0) for job in jobs}
        starving = self._max_skipped_rounds * cdiv(total_rows, self._max_rows)

        def priority(job: Job) -> tuple[bool, int, int]:
            waited = skipped[id(job)]
            return (waited < starving, job.num_steps - job.step_index, -waited)

        chosen, rows = [], 0
        for job in sorted(jobs, key=priority):
            if chosen and rows + job.num_rows > self._max_rows:
                continue
            chosen.append(job)
            rows += job.num_rows
        picked = {id(job) for job in chosen}
        self._skipped = {key: 0 if key in picked else waited + 1 for key, waited in skipped.items()}
        return [job for job in jobs if id(job) in picked]  # batch order stays the engine's
