"""The paged execution of the causal-prefix DiT over ``diffusion_kv``'s batch preparation and K/V ops.

Each row of a job is one ``diffusion_kv`` row (``[prefix | target]`` tokens, role ``PRIMARY_CACHE_ROLE``)
installed in a ``WorkerRowTable``. Forwards run ragged batches of rows laid out flat (``[tokens, width]``); for
each forward ``diffusion_kv.prepare_batch`` builds the attention metadata once, from the row table's own block
tables, and every layer writes and attends through ``PreparedBatch.attention``:
- ``write_prefix``: prompt tokens only (``BatchRow.prefix``); writes each layer's prefix K/V into the rows'
  blocks and attends causally among them (the prefix's own MLPs run too: later layers' K/V depend on them);
- ``predict_velocities``: image tokens only (``BatchRow.target``); writes the rows' target K/V, then attends over
  prefix + target keys. The prefix is never recomputed;
- ``predict_velocities(..., recompute_prefix=True)``: the no-reuse baseline: prefix and image tokens both run
  through every block each step (what a model without prefix caching must do), same outputs;
- ``predict_velocities(..., graphs=StepGraphs())``: the same forward, its device work captured as a CUDA graph on
  the first step of a batch layout and replayed on the following ones (``omni_models.graphs``).
- a batch with a job that has a step cache (``job.step_cache``) runs eagerly through ``omni_models.
  step_cache_blocks.CachedForward``: each block runs on the rows that compute it, with attention metadata
  prepared for that subset of rows. A skipping row writes no target K/V in the middle layers; its stale slots are
  never read, since a row attends to its own keys only and a layer writes a row's target K/V before reading them.
``denoise_step`` turns the velocities into one guided Euler step per job (``GenerationJob.advance``).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from diffusion_kv import (
    PRIMARY_CACHE_ROLE,
    AttentionCacheSpec,
    BatchRow,
    PreparedBatch,
    RowIdentity,
    WorkerRowTable,
    prepare_batch,
)
from omni_models.graphs import StepGraphs
from omni_models.model import QKV, CausalPrefixDiT, JointAttention, patchify, unpatchify
from omni_models.runner import GenerationJob, GenerationRow, ScheduledJob


def _resolved(device: torch.device) -> torch.device:
    """``cuda`` names the current CUDA device; tensors report it with its index (``cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class PagedKV:
    """A KV pool as the paged forwards use it: every attention layer's spec and cache tensor (in block order,
    so ``caches[attn.layer_index]`` is that layer's), and the row table whose block tables address them.

    Invariant (checked here): every cache has the table's block size, lives on the table's device and holds at
    least the table's ``num_blocks`` blocks, so no block id the table accepted can fall outside a cache.
    """

    layers: tuple[AttentionCacheSpec, ...]
    caches: tuple[Tensor, ...]
    rows: WorkerRowTable

    def __post_init__(self) -> None:
        if not self.caches or len(self.caches) != len(self.layers):
            raise ValueError(
                f"need one KV cache per attention layer: {len(self.layers)} layers, {len(self.caches)} caches; "
                "call allocate_kv_caches(num_blocks, block_size) first"
            )
        if PRIMARY_CACHE_ROLE not in self.rows.registered_roles:
            raise ValueError(f"the row table does not register the {PRIMARY_CACHE_ROLE!r} role the model's layers use")
        for spec, cache in zip(self.layers, self.caches, strict=True):
            num_blocks, _, block_size = cache.shape[:3]
            if block_size != self.rows.block_size or num_blocks < self.rows.num_blocks:
                raise ValueError(
                    f"the row table addresses {self.rows.num_blocks} blocks of {self.rows.block_size} tokens, but "
                    f"the cache of {spec.layer_name!r} holds {num_blocks} blocks of {block_size}"
                )
            if cache.device != _resolved(self.rows.device):
                raise ValueError(f"the row table is on {self.rows.device} but the KV caches are on {cache.device}")

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype


class _LayerAttention:
    """The ``attend`` callable of one paged forward: each layer writes and attends through prepared batches."""

    def __init__(self, kv: PagedKV, prefix: PreparedBatch | None, target: PreparedBatch | None) -> None:
        self.kv = kv
        self.prefix = prefix
        self.target = target

    def __call__(
        self, attn: JointAttention, prefix: QKV | None, target: QKV | None
    ) -> tuple[Tensor | None, Tensor | None]:
        layer, cache = self.kv.layers[attn.layer_index], self.kv.caches[attn.layer_index]
        # The prefix goes first: target queries read the prefix keys this forward writes (recompute baseline).
        out_prefix = None if prefix is None else self.prefix.attention(layer, *prefix, cache)
        out_target = None if target is None else self.target.attention(layer, *target, cache)
        return out_prefix, out_target


def _check_jobs(batch: Sequence[ScheduledJob], *, denoise: bool) -> None:
    """Job-level rules (row-level ones are ``prepare_batch``'s); ValueError naming the problem."""
    seen: set[int] = set()
    for scheduled in batch:
        job = scheduled.job
        if id(job) in seen:
            raise ValueError(f"job {job.request_id or id(job)} appears twice in one batch")
        seen.add(id(job))
        if denoise and not job.prefix_written:
            raise ValueError("start() must run for a job before its first denoise step")
        if denoise and job.finished:
            raise ValueError(f"job already ran all {job.num_steps} steps; decode it and free its blocks")


class RowRef(NamedTuple):
    """One CFG row of a scheduled job: the job it advances, the row, and its ``diffusion_kv`` row."""

    job: GenerationJob
    row: GenerationRow
    identity: RowIdentity


def batch_rows(batch: Sequence[ScheduledJob]) -> list[RowRef]:
    """Every row of every job of ``batch``, in forward order (job order, then ``job.rows`` order)."""
    return [
        RowRef(scheduled.job, row, identity)
        for scheduled in batch
        for row, identity in zip(scheduled.job.rows, scheduled.rows, strict=True)
    ]


def prefix_batch(kv: PagedKV, rows: Sequence[RowRef]) -> PreparedBatch:
    return prepare_batch(kv.rows, [BatchRow.prefix(ref.identity, ref.row.prefix_len) for ref in rows])


def prefix_inputs(model: CausalPrefixDiT, rows: Sequence[RowRef], kv: PagedKV) -> Tensor:
    """The prompt-token embeddings of ``rows``, flat ``[prefix tokens, width]``."""
    token_ids = torch.tensor([i for ref in rows for i in ref.row.token_ids], device=kv.device)
    positions = torch.cat([torch.arange(ref.row.prefix_len) for ref in rows]).to(kv.device)
    return model.embed_prefix(token_ids, positions).to(kv.dtype)


@torch.no_grad()
def write_prefix(model: CausalPrefixDiT, kv: PagedKV, batch: Sequence[ScheduledJob]) -> None:
    """Compute and write every row's prefix K/V (all layers); marks the jobs ``prefix_written``."""
    _check_jobs(batch, denoise=False)
    rows = batch_rows(batch)
    attend = _LayerAttention(kv, prefix_batch(kv, rows), None)
    prefix = prefix_inputs(model, rows, kv)
    for block in model.blocks:
        prefix, _ = block(prefix, None, None, attend)
    for scheduled in batch:
        scheduled.job.prefix_written = True


@dataclass(frozen=True)
class _StepPlan:
    """What a denoise forward needs besides the step's latents and timesteps: it depends on the batch layout only."""

    attend: _LayerAttention
    prefix: Tensor | None  # prompt-token embeddings [prefix tokens, width] (recompute baseline only)
    positions: Tensor  # the position-table row of every target token [target tokens, width]
    row_ids: Tensor  # the request row of every target token [target tokens]


def target_plan(model: CausalPrefixDiT, kv: PagedKV, rows: Sequence[RowRef], recompute_prefix: bool) -> _StepPlan:
    """The attention batches, position rows and row ids of a denoise forward over ``rows``."""
    target_batch = prepare_batch(
        kv.rows, [BatchRow.target(ref.identity, ref.row.prefix_len, ref.row.target_len) for ref in rows]
    )
    positions = [model.target_positions(ref.job.request.height, ref.job.request.width, kv.device) for ref in rows]
    target_lens = [ref.row.target_len for ref in rows]
    return _StepPlan(
        attend=_LayerAttention(kv, prefix_batch(kv, rows) if recompute_prefix else None, target_batch),
        prefix=prefix_inputs(model, rows, kv) if recompute_prefix else None,
        positions=torch.cat(positions),
        row_ids=torch.repeat_interleave(
            torch.arange(len(target_lens), device=kv.device), torch.tensor(target_lens, device=kv.device)
        ),
    )


def _velocity(model: CausalPrefixDiT, plan: _StepPlan, patches: Tensor, times: Tensor) -> Tensor:
    """Float32 velocity ``[target tokens, patch_dim]`` of every row: the device work of a step, no host sync."""
    target = model.embed_target(patches, plan.positions)
    cond = model.timestep_condition(times).to(patches.dtype)
    prefix = plan.prefix
    for block in model.blocks:
        prefix, target = block(prefix, target, cond, plan.attend, plan.row_ids)
    return model.final_layer(target, cond, plan.row_ids).float()


def cached_jobs(batch: Sequence[ScheduledJob]) -> list:
    """The step caches of ``batch``'s jobs, in batch order (the same on every rank)."""
    return [scheduled.job.step_cache for scheduled in batch if scheduled.job.step_cache is not None]


def _cached_velocity(
    model: CausalPrefixDiT,
    kv: PagedKV,
    rows: Sequence[RowRef],
    plan: _StepPlan,
    patches: Tensor,
    times: Tensor,
    *,
    reduce=None,
    jobs=None,
) -> Tensor:
    """``_velocity`` with the rows' step caches: each block runs on the rows that compute it (a host read per
    decision boundary, so no CUDA graph). ``reduce``/``jobs``: a rank's share of a multi-rank forward
    (``step_cache_blocks.CachedForward``)."""
    from omni_models.step_cache_blocks import CachedForward, FlatRows, row_slots

    index_in_job: dict[int, int] = {}
    slots = []
    for ref in rows:
        position = index_in_job.get(id(ref.job), 0)
        index_in_job[id(ref.job)] = position + 1
        slots.append((ref.job.step_cache, position, ref.job.step_index))
    layout = FlatRows([ref.row.target_len for ref in rows], kv.device)
    run = CachedForward(row_slots(slots), len(model.blocks), layout, reduce=reduce, jobs=jobs)
    subsets: dict[tuple[int, ...], tuple[_LayerAttention, Tensor]] = {}

    def subset(computing: Tensor) -> tuple[_LayerAttention, Tensor]:
        key = tuple(computing.tolist())
        if key not in subsets:
            chosen = [rows[i] for i in key]
            batch = prepare_batch(
                kv.rows, [BatchRow.target(ref.identity, ref.row.prefix_len, ref.row.target_len) for ref in chosen]
            )
            lengths = torch.tensor([ref.row.target_len for ref in chosen], device=kv.device)
            row_ids = torch.repeat_interleave(torch.arange(len(chosen), device=kv.device), lengths)
            subsets[key] = (_LayerAttention(kv, None, batch), row_ids)
        return subsets[key]

    target = model.embed_target(patches, plan.positions)
    cond = model.timestep_condition(times).to(patches.dtype)
    for index, block in enumerate(model.blocks):
        (target,) = run.at_boundary(index, [target])
        computing = run.computing(index)
        if computing is None:
            _, target = block(None, target, cond, plan.attend, plan.row_ids)
        elif computing.numel():
            attend, row_ids = subset(computing)
            part = layout.gather(target, computing)
            _, part = block(None, part, cond.index_select(0, computing), attend, row_ids)
            target = layout.scatter(target, part, computing)
    (target,) = run.at_boundary(len(model.blocks), [target])
    run.finish()
    return model.final_layer(target, cond, plan.row_ids).float()


def _layout_key(kv: PagedKV, batch: Sequence[ScheduledJob], recompute_prefix: bool) -> Hashable:
    """What a captured step depends on besides its inputs: the rows (and their lengths, sizes, prompts when
    recomputed), the row table's state (its version moves whenever a row is installed or retired) and the pool."""
    rows = tuple(
        (
            identity,
            row.token_ids if recompute_prefix else row.prefix_len,
            row.target_len,
            scheduled.job.request.height,
            scheduled.job.request.width,
        )
        for scheduled in batch
        for row, identity in zip(scheduled.job.rows, scheduled.rows, strict=True)
    )
    return rows, recompute_prefix, id(kv.rows), kv.rows.version, kv.caches[0].data_ptr(), len(kv.caches)


@torch.no_grad()
def predict_velocities(
    model: CausalPrefixDiT,
    kv: PagedKV,
    batch: Sequence[ScheduledJob],
    *,
    recompute_prefix: bool = False,
    graphs: StepGraphs | None = None,
) -> list[list[Tensor]]:
    """The model's velocity for every row of every job at the job's current step: ``[job][row]`` float32
    ``[C, H, W]``, all rows through one forward.

    With ``recompute_prefix`` the prompt tokens also run through every block and rewrite their K/V first (the
    no-reuse baseline); it does not need ``write_prefix`` to have run. With ``graphs`` (CUDA) the forward is
    captured as a CUDA graph on the first step of a batch layout and replayed on later steps.
    """
    if recompute_prefix:
        for scheduled in batch:
            scheduled.job.prefix_written = True
    _check_jobs(batch, denoise=True)
    patches, row_times = [], []
    for scheduled in batch:
        job = scheduled.job
        job_patches = patchify(job.latents.unsqueeze(0), model.config.patch_size)[0]
        for _ in job.rows:
            patches.append(job_patches)
            row_times.append(job.times[job.step_index])
    patches = torch.cat(patches).to(kv.dtype)
    times = torch.tensor(row_times, device=kv.device)
    if any(scheduled.job.step_cache is not None for scheduled in batch):
        if recompute_prefix:
            raise ValueError("recompute_prefix is the uncached benchmark baseline; run it without a step cache")
        rows = batch_rows(batch)
        velocity = _cached_velocity(model, kv, rows, target_plan(model, kv, rows, False), patches, times)
    elif graphs is not None and kv.device.type == "cuda":
        velocity = graphs.run(
            _layout_key(kv, batch, recompute_prefix),
            lambda: target_plan(model, kv, batch_rows(batch), recompute_prefix),
            functools.partial(_velocity, model),
            patches,
            times,
        )
    else:
        velocity = _velocity(model, target_plan(model, kv, batch_rows(batch), recompute_prefix), patches, times)

    config = model.config
    per_job, offset = [], 0
    for scheduled in batch:
        request = scheduled.job.request
        rows = []
        for row in scheduled.job.rows:
            tokens = velocity[offset : offset + row.target_len].unsqueeze(0)
            rows.append(unpatchify(tokens, config.patch_size, request.height, request.width, config.in_channels)[0])
            offset += row.target_len
        per_job.append(rows)
    return per_job


def denoise_step(
    model: CausalPrefixDiT,
    kv: PagedKV,
    batch: Sequence[ScheduledJob],
    *,
    recompute_prefix: bool = False,
    graphs: StepGraphs | None = None,
) -> None:
    """One guided Euler step for every job of the batch (all rows in one forward); advances ``job.step_index``."""
    velocities = predict_velocities(model, kv, batch, recompute_prefix=recompute_prefix, graphs=graphs)
    for scheduled, row_velocities in zip(batch, velocities, strict=True):
        scheduled.job.advance(row_velocities)
