"""Fair scheduling policy of the paged engine: which waiting requests are admitted (``FairAdmission``), and
which admitted jobs advance in each forward (``StepSelection``).

Admission
---------

``diffusion_kv``'s scheduler admits from the head of its queue while the head's rows fit the block pool;
a head that does not fit blocks everything behind it. Behind one big request (``n=10`` guided images)
waiting for blocks, a 2-step single image would wait for a whole long request to finish, although the free
blocks could hold it now. This policy keeps waiting requests here and hands the scheduler, oldest first, only
requests that fit *now* (free blocks and free running slots), so a small request overtakes a big one that
must wait anyway. Two rules keep it fair and correct:

- **No starvation**: once the oldest waiting request has been overtaken ``max_overtakes`` times, nothing
  overtakes it any more; the blocks freed from then on accumulate for it.
- **Fail fast**: a request that could not fit even the empty pool is handed over at once, so the scheduler
  fails it alone with its capacity error.

While the scheduler still has a waiting request of its own (an estimate was short), nothing else is handed
over, so the scheduler's FIFO order and its row-pool bound are never contended. Blocks needed are estimated
as ``sum(ceil(row tokens / block_size))`` over the request's CFG rows, which is what a reservation takes.

Rows per forward
----------------
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

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from diffusion_kv import cdiv

R = TypeVar("R")
DEFAULT_MAX_OVERTAKES = 16
MAX_SKIPPED_ROUNDS = 2


def blocks_for_rows(row_tokens: list[int], block_size: int) -> int:
    return sum(cdiv(tokens, block_size) for tokens in row_tokens)


class FairAdmission(Generic[R]):
    """Requests waiting for admission, oldest first; ``release`` picks the ones to hand to the scheduler."""

    def __init__(self, *, request_id: Callable[[R], str], max_overtakes: int = DEFAULT_MAX_OVERTAKES) -> None:
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {max_overtakes}")
        self._request_id = request_id
        self._max_overtakes = max_overtakes
        self._waiting: OrderedDict[str, tuple[R, int]] = OrderedDict()  # id -> (request, blocks needed)
        self._oldest_overtaken = 0  # times the current oldest request has been overtaken

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: R, blocks_needed: int) -> None:
        self._waiting[self._request_id(request)] = (request, blocks_needed)

    def remove(self, request_id: str) -> R | None:
        entry = self._waiting.pop(request_id, None)
        if entry is not None and not self._waiting:
            self._oldest_overtaken = 0
        return None if entry is None else entry[0]

    def clear(self) -> None:
        self._waiting.clear()
        self._oldest_overtaken = 0

    def release(self, *, free_blocks: int, free_slots: int, pool_blocks: int) -> list[R]:
        """Requests to hand to the scheduler now, oldest first; they leave this queue."""
        released: list[R] = []
        for request_id, (request, needed) in list(self._waiting.items()):
            if needed > pool_blocks:  # can never fit: let the scheduler fail it now
                released.append(request)
                del self._waiting[request_id]
        oldest_id = next(iter(self._waiting), None)
        for request_id, (request, needed) in list(self._waiting.items()):
            if free_slots <= 0:
                break
            is_oldest = request_id == oldest_id
            if not is_oldest and self._oldest_overtaken >= self._max_overtakes:
                break  # the oldest has waited long enough: nobody overtakes it
            if needed <= free_blocks:
                released.append(request)
                del self._waiting[request_id]
                free_blocks -= needed
                free_slots -= 1
                if is_oldest:
                    self._oldest_overtaken = 0
                    oldest_id = next(iter(self._waiting), None)
                else:
                    self._oldest_overtaken += 1
        if not self._waiting:
            self._oldest_overtaken = 0
        return released


class StepSelection:
    """Chooses the jobs of one forward under a row budget (``max_rows`` 0: every job, every forward)."""

    def __init__(self, max_rows: int, *, max_skipped_rounds: int = MAX_SKIPPED_ROUNDS) -> None:
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (0: no limit), got {max_rows}")
        self._max_rows = max_rows
        self._max_skipped_rounds = max_skipped_rounds
        self._skipped: dict[int, int] = {}  # id(job) -> consecutive forwards it was left out of

    def select(self, scheduled: Sequence[Any]) -> list[Any]:
        """``scheduled``: unfinished ``ScheduledJob``s (``.job.rows``, ``.job.num_steps``, ``.job.step_index``)."""
        total_rows = sum(len(s.job.rows) for s in scheduled)
        if not self._max_rows or total_rows <= self._max_rows:
            self._skipped.clear()
            return list(scheduled)
        skipped = {id(s.job): self._skipped.get(id(s.job), 0) for s in scheduled}
        starving = self._max_skipped_rounds * cdiv(total_rows, self._max_rows)

        def priority(s: Any) -> tuple[bool, int, int]:
            waited = skipped[id(s.job)]
            return (waited < starving, s.job.num_steps - s.job.step_index, -waited)

        chosen, rows = [], 0
        for s in sorted(scheduled, key=priority):
            if chosen and rows + len(s.job.rows) > self._max_rows:
                continue
            chosen.append(s)
            rows += len(s.job.rows)
        picked = {id(s.job) for s in chosen}
        self._skipped = {key: 0 if key in picked else waited + 1 for key, waited in skipped.items()}
        return [s for s in scheduled if id(s.job) in picked]  # batch order stays the engine's
