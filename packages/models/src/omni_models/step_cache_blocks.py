"""The tensor side of step caching (``omni_models.step_cache`` is the policy): what a cached row holds, and one
batched forward in which every row decides for itself.

``JobStepCache`` is one job's state: its config, its policy history (``step_cache.Decisions``) and per row (cond,
uncond) a ``RowCache``: the first blocks' residual at the row's last computed step (the residual test's
reference) and the middle's residual per stream as Taylor factors (order 0: the residual itself). Its memory is
bounded by ``JobStepCache.bytes_bound`` (the same layout every step), and ``release`` drops it.

``CachedForward`` runs the cache inside one forward over rows of many jobs, each at its own step and with its own
knobs. The forward is a walk over the ``N`` repeated blocks; between block ``k - 1`` and block ``k`` (boundary
``k``; boundary ``N`` follows the last block) it:
- at boundary 0, keeps the blocks' input (the first blocks' residual is measured from it);
- at boundary ``F`` of a job, decides: the residual test measures its rows' change against their last computed
  step in one batched reduction and one host read for every job deciding there; a mask needs no measurement;
- at boundary ``N - B`` of a job, stores the middle's residual of a computing row, or adds the cached (or
  forecast) residual to a skipping row.
``computing(k)`` says which rows run block ``k``: rows without a cache, rows in their first or last blocks, and
rows whose job computes this step. The caller runs the block on exactly those rows (gathered, then scattered back
into the batch), so rows that skip never enter the middle blocks; a block no row computes is not called at all.

Rows are laid out either batched (``BatchedRows``: ``[rows, tokens, width]``, the diffusers families) or flat
(``FlatRows``: ``[tokens, width]`` with each row's tokens contiguous, the paged DiT).

``CachedBlockList`` puts this under a diffusers transformer without editing its classes: each block list
(``transformer_blocks``, ``single_transformer_blocks``) is replaced by a ``ModuleList`` of the same modules
(same parameter names), which yields the real blocks as usual and, while a ``CachedForward`` is active, callables
that gather each block's row inputs (``hidden_states``, ``encoder_hidden_states``, ``temb``, the text lengths of
the attention kwargs) for the computing rows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from omni_models.step_cache import Decisions, StepCacheConfig, decide, needs_probe, relative_change, stats_of

# --- what one job holds -------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RowCache:
    """One row's tensors: ``probe`` (the first blocks' residual at the last computed step) and ``factors`` (per
    stream, the middle residual and its finite differences over computed steps, at step ``at``)."""

    probe: Tensor | None = None
    factors: list[list[Tensor]] = field(default_factory=list)
    at: int | None = None

    def update(self, step: int, residuals: Sequence[Tensor], order: int) -> None:
        """A computed step's middle residuals: new Taylor factors (a difference per order the history allows)."""
        new = []
        for stream, residual in enumerate(residuals):
            factors = [residual]
            if self.at is not None and self.factors:
                dt = float(step - self.at)
                old = self.factors[stream]
                for k in range(1, order + 1):
                    if len(old) < k:
                        break
                    factors.append((factors[k - 1] - old[k - 1]) / dt)
            new.append(factors)
        self.factors, self.at = new, step

    def forecast(self, step: int) -> list[Tensor]:
        """The middle residual of each stream at ``step``: the Taylor series around the last computed step."""
        assert self.at is not None, "a row skips only after a computed step"
        dt = float(step - self.at)
        out = []
        for factors in self.factors:
            value = factors[0]
            for k in range(1, len(factors)):
                value = value + factors[k] * (dt**k / math.factorial(k))
            out.append(value)
        return out

    def nbytes(self) -> int:
        tensors = [t for factors in self.factors for t in factors] + ([self.probe] if self.probe is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(eq=False)
class JobStepCache:
    """One job's step cache: its knobs, its decisions and one ``RowCache`` per row of the job."""

    config: StepCacheConfig
    num_blocks: int
    decisions: Decisions
    rows: list[RowCache]
    pending: bool | None = None  # this step's decision, between the decision boundary and the forward's end
    pending_diff: float | None = None

    @classmethod
    def create(cls, config: StepCacheConfig, *, num_blocks: int, num_steps: int, num_rows: int) -> JobStepCache:
        return cls(config, num_blocks, Decisions(num_steps=num_steps), [RowCache() for _ in range(num_rows)])

    @property
    def first(self) -> int:
        return self.config.first_blocks

    @property
    def end(self) -> int:
        """The boundary where the middle ends (``N - B``)."""
        return self.num_blocks - self.config.last_blocks

    @staticmethod
    def bytes_bound(config: StepCacheConfig, row_streams: Sequence[Sequence[int]], element_size: int) -> int:
        """The most this job's state holds: per row, ``taylor_order + 1`` tensors of each stream's elements (the
        middle residual and its differences) plus the first stream once (the residual test's reference)."""
        if not config.enabled:
            return 0
        probe = 1 if needs_probe(config) else 0
        return sum(
            element_size * ((config.taylor_order + 1) * sum(streams) + probe * streams[0]) for streams in row_streams
        )

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def release(self) -> None:
        for row in self.rows:
            row.probe, row.factors, row.at = None, [], None

    def finish_step(self) -> None:
        """Record this step's decision (the forward ran to the end)."""
        if self.pending is not None:
            self.decisions.record(self.pending, self.pending_diff)
        self.pending, self.pending_diff = None, None

    def stats(self):
        return stats_of(self.config, self.decisions, self.num_blocks)


# --- row layouts --------------------------------------------------------------------------------------------------


class RowLayout(Protocol):
    """How the rows of one forward sit in its token tensors."""

    num_rows: int

    def view(self, x: Tensor, row: int, stream: int = 0) -> Tensor: ...
    def gather(self, x: Tensor, rows: Tensor) -> Tensor: ...
    def scatter(self, full: Tensor, part: Tensor, rows: Tensor) -> Tensor: ...


class BatchedRows:
    """``[rows, tokens, ...]`` tensors: row ``r`` is ``x[r]``; with ``lengths[stream]`` given, only the first
    ``lengths[stream][r]`` tokens of that stream are the row's own (Qwen-Image's text, padded to the longest row of
    the forward: the padding differs with the neighbours, so a row's state never holds it)."""

    def __init__(self, num_rows: int, lengths: dict[int, Sequence[int]] | None = None) -> None:
        self.num_rows = num_rows
        self.lengths = lengths or {}

    def view(self, x: Tensor, row: int, stream: int = 0) -> Tensor:
        lengths = self.lengths.get(stream)
        return x[row] if lengths is None else x[row, : lengths[row]]

    def gather(self, x: Tensor, rows: Tensor) -> Tensor:
        return x.index_select(0, rows)

    def scatter(self, full: Tensor, part: Tensor, rows: Tensor) -> Tensor:
        return full.index_copy(0, rows, part)


class FlatRows:
    """``[tokens, ...]`` tensors whose rows' tokens are contiguous, ``lengths[r]`` tokens for row ``r``."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        self.num_rows = len(lengths)
        self.lengths = list(lengths)
        self.offsets = [0]
        for length in self.lengths:
            self.offsets.append(self.offsets[-1] + length)
        self.device = device
        self._tokens: dict[tuple[int, ...], Tensor] = {}

    def view(self, x: Tensor, row: int, stream: int = 0) -> Tensor:
        return x[self.offsets[row] : self.offsets[row + 1]]

    def tokens(self, rows: Tensor) -> Tensor:
        key = tuple(rows.tolist())
        if key not in self._tokens:
            ranges = [torch.arange(self.offsets[r], self.offsets[r + 1]) for r in key]
            self._tokens[key] = torch.cat(ranges).to(self.device)
        return self._tokens[key]

    def gather(self, x: Tensor, rows: Tensor) -> Tensor:
        return x.index_select(0, self.tokens(rows))

    def scatter(self, full: Tensor, part: Tensor, rows: Tensor) -> Tensor:
        return full.index_copy(0, self.tokens(rows), part)


# --- one forward ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSlot:
    """A row of the forward that caches: its job's state, its index among the job's rows, the job's step."""

    job: JobStepCache
    row: int
    step: int


Reduce = Callable[[Tensor], Tensor]  # [jobs, 2] partial sums -> the same summed over every rank of the forward


class CachedForward:
    """The step cache inside one forward (see the module docstring). ``slots[r]`` is None for a row that does not
    cache.

    Several ranks (CFG-parallel rows, sequence-parallel token slices): ``jobs`` lists every caching job of the whole
    forward in the same order on every rank, and ``reduce`` sums each deciding job's partial numerator and
    denominator over the ranks (one collective per decision boundary, on every rank), so every rank takes every
    job's decision and records it, whether or not it holds the job's rows. A rank without rows in the forward calls
    ``idle()``.
    """

    def __init__(
        self,
        slots: Sequence[RowSlot | None],
        num_blocks: int,
        layout: RowLayout | None,
        *,
        reduce: Reduce | None = None,
        jobs: Sequence[JobStepCache] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.slots = list(slots)
        self.num_blocks = num_blocks
        self.layout = layout
        self.reduce = reduce
        self.jobs = (
            list(jobs) if jobs is not None else list({id(s.job): s.job for s in self.slots if s is not None}.values())
        )
        self._device = device
        self._input: Tensor | None = None
        self._middle_start: dict[int, list[Tensor]] = {}
        self._computing: dict[tuple[int, ...], Tensor | None] = {}
        for job in self.jobs:
            job.pending, job.pending_diff = None, None

    @property
    def active(self) -> bool:
        return bool(self.jobs)

    def computing(self, block: int) -> Tensor | None:
        """The rows that run ``block`` (an index tensor), or None when every row does."""
        rows = [
            r
            for r, slot in enumerate(self.slots)
            if slot is None or block < slot.job.first or block >= slot.job.end or slot.job.pending
        ]
        if len(rows) == len(self.slots):
            return None
        key = tuple(rows)
        if key not in self._computing:
            self._computing[key] = torch.tensor(rows, dtype=torch.long, device=self._device)
        return self._computing[key]

    def at_boundary(self, index: int, streams: list[Tensor]) -> list[Tensor]:
        """Apply what happens between block ``index - 1`` and block ``index`` (see the module docstring);
        returns the streams the next block reads (skipping rows get their residual where their middle ends)."""
        if self._device is None:
            self._device = streams[0].device
        if index == 0:
            self._input = streams[0]
        if any(job.first == index for job in self.jobs):
            self._decide(index, streams)
        ending = [r for r, s in enumerate(self.slots) if s is not None and s.job.end == index]
        if ending:
            streams = self._end_middle(ending, streams)
        return streams

    def idle(self) -> None:
        """A rank with no rows in this forward: take part in every decision (and record it) all the same."""
        for index in sorted({job.first for job in self.jobs}):
            self._decide(index, None)
        self.finish()

    def finish(self) -> None:
        """Record every job's decision for this step (call after the forward's last block ran)."""
        for job in self.jobs:
            job.finish_step()

    def _decide(self, index: int, streams: list[Tensor] | None) -> None:
        layout, slots = self.layout, self.slots
        deciding = [job for job in self.jobs if job.first == index]
        local: dict[int, list[int]] = {id(job): [] for job in deciding}
        for r, slot in enumerate(slots):
            if slot is not None and id(slot.job) in local:
                local[id(slot.job)].append(r)
        probed = [job for job in deciding if needs_probe(job.config)]
        probes: dict[int, Tensor] = {}
        measured: dict[int, tuple[float, float]] = {}
        if probed:
            sums = []
            for job in probed:
                total = torch.zeros(2, dtype=torch.float32, device=self._device)
                for r in local[id(job)]:
                    probe = layout.view(streams[0], r) - layout.view(self._input, r)
                    probes[r] = probe
                    previous = job.rows[slots[r].row].probe
                    if previous is not None:
                        total = total + torch.stack([(probe - previous).abs().sum(), previous.abs().sum()]).float()
                sums.append(total)
            stacked = torch.stack(sums)
            if self.reduce is not None:
                stacked = self.reduce(stacked)
            for job, (num, den) in zip(probed, stacked.tolist(), strict=True):
                measured[id(job)] = (num, den)
        for job in deciding:
            diff = None
            if id(job) in measured:
                numerator, denominator = measured[id(job)]
                diff = relative_change([numerator], [denominator])
            step = len(job.decisions.computed)  # every step of a job is decided once, in order
            job.pending = decide(job.config, job.decisions, step, diff)
            job.pending_diff = diff
            if job.pending:
                for r in local[id(job)]:
                    if r in probes:
                        job.rows[slots[r].row].probe = probes[r]
                    self._middle_start[r] = [layout.view(s, r, i) for i, s in enumerate(streams)]

    def _end_middle(self, rows: list[int], streams: list[Tensor]) -> list[Tensor]:
        layout, slots = self.layout, self.slots
        skipping = [r for r in rows if not slots[r].job.pending]
        for r in rows:
            slot = slots[r]
            if slot.job.pending:
                start = self._middle_start.pop(r)
                residuals = [layout.view(s, r, i) - s0 for i, (s, s0) in enumerate(zip(streams, start, strict=True))]
                slot.job.rows[slot.row].update(slot.step, residuals, slot.job.config.taylor_order)
        if not skipping:
            return streams
        out = [s.clone() for s in streams]
        for r in skipping:
            slot = slots[r]
            for i, residual in enumerate(slot.job.rows[slot.row].forecast(slot.step)):
                layout.view(out[i], r, i).add_(residual)
        return out


# --- diffusers block lists ------------------------------------------------------------------------------------------

# The keyword arguments of a diffusers family's block that carry one entry per row (FLUX.1's double and single
# blocks, Qwen-Image's blocks); everything else (rotary embeddings, the attention kwargs' other keys) is shared.
ROW_KEYWORDS = ("hidden_states", "encoder_hidden_states", "temb", "encoder_hidden_states_mask")
ROW_ATTENTION_KWARGS = ("text_lengths",)
ATTENTION_KWARGS = ("joint_attention_kwargs", "attention_kwargs")


class _Active:
    run: CachedForward | None = None


class _CachedBlockCall:
    """Block ``index`` of the walk, called as the transformer calls it (keywords), on the computing rows only.
    Blocks return ``(encoder_hidden_states, hidden_states)``; the streams are ``[hidden, encoder]``."""

    def __init__(self, block: nn.Module, index: int, run: CachedForward) -> None:
        self.block, self.index, self.run = block, index, run

    def __call__(self, **kwargs: Any) -> tuple[Tensor, Tensor]:
        run = self.run
        hidden, encoder = run.at_boundary(self.index, [kwargs["hidden_states"], kwargs["encoder_hidden_states"]])
        kwargs = {**kwargs, "hidden_states": hidden, "encoder_hidden_states": encoder}
        rows = run.computing(self.index)
        if rows is None:
            encoder, hidden = self.block(**kwargs)
        elif rows.numel():
            encoder_part, hidden_part = self.block(**_gather_rows(kwargs, rows))
            hidden = run.layout.scatter(hidden, hidden_part, rows)
            encoder = run.layout.scatter(encoder, encoder_part, rows)
        if self.index == run.num_blocks - 1:
            hidden, encoder = run.at_boundary(run.num_blocks, [hidden, encoder])
        return encoder, hidden


class _CachedCrossBlockCall(_CachedBlockCall):
    """A ``"cross"`` block (Wan): called positionally ``(hidden_states, encoder_hidden_states, temb, rotary_emb)``,
    returning ``hidden_states``; one stream (the text is only read as cross-attention keys). The per-row inputs are
    the first three (``temb``: one row per video, or per token for Wan2.2 TI2V); the rotary tables are shared."""

    def __call__(self, hidden_states: Tensor, encoder_hidden_states: Tensor, temb: Tensor, rotary_emb: Any) -> Tensor:
        run = self.run
        (hidden,) = run.at_boundary(self.index, [hidden_states])
        rows = run.computing(self.index)
        if rows is None:
            hidden = self.block(hidden, encoder_hidden_states, temb, rotary_emb)
        elif rows.numel():
            picked = [x.index_select(0, rows) for x in (hidden, encoder_hidden_states, temb)]
            hidden = run.layout.scatter(hidden, self.block(*picked, rotary_emb), rows)
        if self.index == run.num_blocks - 1:
            (hidden,) = run.at_boundary(run.num_blocks, [hidden])
        return hidden


BLOCK_CALLS = {"joint": _CachedBlockCall, "cross": _CachedCrossBlockCall}


def _gather_rows(kwargs: dict[str, Any], rows: Tensor) -> dict[str, Any]:
    out = dict(kwargs)
    for name in ROW_KEYWORDS:
        value = out.get(name)
        if isinstance(value, Tensor):
            out[name] = value.index_select(0, rows)
    picked = rows.tolist()
    for name in ATTENTION_KWARGS:
        extra = out.get(name)
        if isinstance(extra, dict) and any(key in extra for key in ROW_ATTENTION_KWARGS):
            out[name] = {
                key: [value[i] for i in picked] if key in ROW_ATTENTION_KWARGS and value is not None else value
                for key, value in extra.items()
            }
    return out


class CachedBlockList(nn.ModuleList):
    """A block list of a diffusers transformer holding the same blocks (see the module docstring)."""

    def __init__(self, blocks: nn.ModuleList, offset: int, active: _Active, block_call: str = "joint") -> None:
        super().__init__(list(blocks))
        self._offset = offset
        self._active = active
        self._call = BLOCK_CALLS[block_call]

    def __iter__(self) -> Iterator[Any]:
        run = self._active.run
        if run is None:
            return super().__iter__()
        return iter([self._call(block, self._offset + i, run) for i, block in enumerate(super().__iter__())])


class TransformerBlockCache:
    """The step cache installed on one diffusers transformer's block lists (in the order its forward runs them);
    ``block_call`` says how the forward calls its blocks (``FamilyDeclaration.block_call``)."""

    def __init__(self, transformer: nn.Module, block_lists: Sequence[str], block_call: str = "joint") -> None:
        self._active = _Active()
        offset = 0
        for path in block_lists:
            blocks = transformer.get_submodule(path)
            if not isinstance(blocks, CachedBlockList):
                parent_path, _, name = path.rpartition(".")
                parent = transformer.get_submodule(parent_path) if parent_path else transformer
                setattr(parent, name, CachedBlockList(blocks, offset, self._active, block_call))
            offset += len(blocks)
        self.num_blocks = offset

    @contextlib.contextmanager
    def forward(self, run: CachedForward) -> Iterator[CachedForward]:
        """The transformer's forwards inside this block run ``run``'s cache; ``run.finish()`` when it completes."""
        self._active.run = run if run.active else None
        try:
            yield run
        finally:
            self._active.run = None
        run.finish()


@dataclass
class StepCachePlan:
    """The step caches of one family forward's rows (``slots``, every row of the forward) over a transformer's
    ``blocks``; a rank runs it on its share of the rows (``forward``) or on none (``idle``)."""

    slots: list[RowSlot | None]
    text_lengths: list[int] | None  # per row, where rows' text is ragged (Qwen-Image); None: all the same
    blocks: TransformerBlockCache

    @property
    def jobs(self) -> list[JobStepCache]:
        return list({id(s.job): s.job for s in self.slots if s is not None}.values())

    @contextlib.contextmanager
    def forward(self, indices: Sequence[int], reduce: Reduce | None = None) -> Iterator[CachedForward]:
        """The transformer's forwards inside this block run the cache of rows ``indices`` (in that order)."""
        local = [self.slots[i] for i in indices]
        lengths = None if self.text_lengths is None else {1: [self.text_lengths[i] for i in indices]}
        run = CachedForward(
            local, self.blocks.num_blocks, BatchedRows(len(local), lengths), reduce=reduce, jobs=self.jobs
        )
        with self.blocks.forward(run):
            yield run

    def idle(self, reduce: Reduce | None, device: torch.device) -> None:
        CachedForward([], self.blocks.num_blocks, None, reduce=reduce, jobs=self.jobs, device=device).idle()


def all_reduce_sum(group: Any = None) -> Reduce:
    """The ``reduce`` of a forward spread over the ranks of ``group`` (default: WORLD, every rank of a request)."""
    import torch.distributed as dist

    def reduce(sums: Tensor) -> Tensor:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return sums

    return reduce


def row_slots(caches: Sequence[tuple[JobStepCache | None, int, int]]) -> list[RowSlot | None]:
    """``(job cache or None, row index in its job, the job's step)`` per row -> the forward's slots."""
    return [None if cache is None else RowSlot(cache, row, step) for cache, row, step in caches]


__all__ = [
    "BatchedRows",
    "CachedBlockList",
    "CachedForward",
    "FlatRows",
    "JobStepCache",
    "RowCache",
    "RowSlot",
    "StepCachePlan",
    "TransformerBlockCache",
    "all_reduce_sum",
    "row_slots",
]
