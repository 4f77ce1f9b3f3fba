"""The paged execution of the causal-prefix DiT over ``diffusion_kv``'s K/V ops.

Three forwards, all over ragged batches of rows laid out flat (``[tokens, width]``):
- ``write_prefix``: prompt tokens only; writes each layer's prefix K/V into the rows' blocks and attends
  causally among them (the prefix's own MLPs run too, because later layers' K/V depend on them).
- ``denoise_step``: image tokens only; writes the rows' target K/V, then attends over prefix + target keys read
  through the block tables. The prefix is never recomputed.
- ``denoise_step(..., recompute_prefix=True)``: the no-reuse baseline: prefix and image tokens both run through
  every block each step (what a model without prefix caching must do), same outputs.
Row metadata follows ``omni_models.runner``: slot of position p = table[p // block_size] * block_size + p % bs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusion_kv import paged_attention, write_kv_cache
from torch import Tensor

from omni_models.flow import euler_step, guided_velocity
from omni_models.model import CausalPrefixDiT, patchify, unpatchify
from omni_models.runner import GenerationRow, ScheduledJob


@dataclass(frozen=True)
class RowLayout:
    """Attention metadata of a ragged batch of rows for one kind of forward (device tensors)."""

    block_tables: Tensor       # int32 [R, max_blocks]
    query_start_loc: Tensor    # int32 [R + 1]
    seq_lens: Tensor           # int32 [R]
    query_pos_start: Tensor    # int32 [R]
    causal_prefix_lens: Tensor | None
    slot_mapping: Tensor       # int64 [total queries]
    max_query_len: int


def _row_slots(table: Sequence[int], start: int, stop: int, block_size: int) -> Tensor:
    positions = torch.arange(start, stop)
    blocks = torch.as_tensor(list(table), dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def _layout(
    rows: Sequence[tuple[GenerationRow, Sequence[int]]], *, target: bool, block_size: int, device: torch.device
) -> RowLayout:
    """Metadata for the prefix (``target=False``) or the target (``target=True``) tokens of every row."""
    max_blocks = max(len(table) for _, table in rows)
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    query_lens, seq_lens, pos_start, slots = [], [], [], []
    for index, (row, table) in enumerate(rows):
        tables[index, : len(table)] = torch.as_tensor(list(table), dtype=torch.int32)
        start, stop = (row.prefix_len, row.num_tokens) if target else (0, row.prefix_len)
        query_lens.append(stop - start)
        seq_lens.append(stop)
        pos_start.append(start)
        slots.append(_row_slots(table, start, stop, block_size))
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    prefix_lens = torch.tensor([row.prefix_len for row, _ in rows], dtype=torch.int32)
    return RowLayout(
        block_tables=tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_pos_start=torch.tensor(pos_start, dtype=torch.int32).to(device),
        causal_prefix_lens=None if target else prefix_lens.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(query_lens),
    )


def _attend(query: Tensor, kv_cache: Tensor, layout: RowLayout) -> Tensor:
    return paged_attention(
        query, kv_cache, layout.block_tables, layout.query_start_loc, layout.seq_lens, layout.query_pos_start,
        causal_prefix_lens=layout.causal_prefix_lens, max_query_len=layout.max_query_len,
    )


def check_batch(batch: Sequence[ScheduledJob], kv_caches: Sequence[Tensor], *, denoise: bool) -> int:
    """Validate a batch against the bound caches; returns the block size. Raises ValueError naming the problem."""
    if not kv_caches:
        raise ValueError("no KV caches are bound: call allocate_kv_caches(num_blocks, block_size) first")
    if not batch:
        raise ValueError("the batch is empty")
    num_blocks, _, block_size = kv_caches[0].shape[:3]
    seen: set[int] = set()
    for scheduled in batch:
        job = scheduled.job
        if id(job) in seen:
            raise ValueError(f"job {job.request_id or id(job)} appears twice in one batch")
        seen.add(id(job))
        if len(scheduled.block_tables) != len(job.rows):
            raise ValueError(f"job has {len(job.rows)} rows but {len(scheduled.block_tables)} block tables")
        for row, table in zip(job.rows, scheduled.block_tables):
            if len(table) * block_size < row.num_tokens:
                raise ValueError(
                    f"{row.role} row needs {row.num_tokens} slots (ceil to {-(-row.num_tokens // block_size)} blocks "
                    f"of {block_size}) but its block table has {len(table)} blocks"
                )
            bad = [block for block in table if not 0 <= block < num_blocks]
            if bad:
                raise ValueError(f"block ids {bad[:4]} are outside the pool of {num_blocks} blocks")
        if denoise and not job.prefix_written:
            raise ValueError("run_prefix must run for a job before its first denoise step")
        if denoise and job.finished:
            raise ValueError(f"job already ran all {job.num_steps} steps; decode it and free its blocks")
    return int(block_size)


def _rows(batch: Sequence[ScheduledJob]) -> list[tuple[GenerationRow, Sequence[int]]]:
    return [pair for scheduled in batch for pair in zip(scheduled.job.rows, scheduled.block_tables)]


def _prefix_inputs(model: CausalPrefixDiT, rows, device: torch.device, dtype: torch.dtype) -> Tensor:
    token_ids = torch.tensor([i for row, _ in rows for i in row.token_ids], device=device)
    positions = torch.cat([torch.arange(row.prefix_len) for row, _ in rows]).to(device)
    return model.embed_prefix(token_ids, positions).to(dtype)


@torch.no_grad()
def write_prefix(model: CausalPrefixDiT, batch: Sequence[ScheduledJob], kv_caches: Sequence[Tensor]) -> None:
    """Compute and write every row's prefix K/V (all layers); marks the jobs ``prefix_written``."""
    block_size = check_batch(batch, kv_caches, denoise=False)
    device, dtype = kv_caches[0].device, kv_caches[0].dtype
    rows = _rows(batch)
    layout = _layout(rows, target=False, block_size=block_size, device=device)
    prefix = _prefix_inputs(model, rows, device, dtype)

    def attend(attn, q_p, k_p, v_p, q_t, k_t, v_t):
        cache = kv_caches[attn.layer_index]
        write_kv_cache(k_p, v_p, cache, layout.slot_mapping)
        return _attend(q_p, cache, layout), None

    for block in model.blocks:
        prefix, _ = block(prefix, None, None, attend)
    for scheduled in batch:
        scheduled.job.prefix_written = True


@torch.no_grad()
def denoise_step(
    model: CausalPrefixDiT,
    batch: Sequence[ScheduledJob],
    kv_caches: Sequence[Tensor],
    *,
    recompute_prefix: bool = False,
) -> None:
    """One Euler step for every job of the batch (all rows in one forward); advances ``job.step_index``.

    With ``recompute_prefix`` the prompt tokens also run through every block and rewrite their K/V first (the
    no-reuse baseline); it does not need ``run_prefix`` to have run.
    """
    if recompute_prefix:
        for scheduled in batch:
            scheduled.job.prefix_written = True
    block_size = check_batch(batch, kv_caches, denoise=True)
    device, dtype = kv_caches[0].device, kv_caches[0].dtype
    rows = _rows(batch)
    layout = _layout(rows, target=True, block_size=block_size, device=device)
    prefix_layout = _layout(rows, target=False, block_size=block_size, device=device) if recompute_prefix else None

    patches, positions, row_times = [], [], []
    for scheduled in batch:
        job = scheduled.job
        height, width = job.request.height, job.request.width
        job_patches = patchify(job.latents.unsqueeze(0), model.config.patch_size)[0]
        table = model.target_positions(height, width, device)
        for _ in job.rows:
            patches.append(job_patches)
            positions.append(table)
            row_times.append(job.times[job.step_index])
    target = model.embed_target(torch.cat(patches).to(dtype), torch.cat(positions))
    target_len = torch.tensor([row.target_len for row, _ in rows], device=device)
    row_ids = torch.repeat_interleave(torch.arange(len(rows), device=device), target_len)
    cond = model.timestep_condition(torch.tensor(row_times, device=device)).to(dtype)
    prefix = _prefix_inputs(model, rows, device, dtype) if recompute_prefix else None

    def attend(attn, q_p, k_p, v_p, q_t, k_t, v_t):
        cache = kv_caches[attn.layer_index]
        out_p = None
        if q_p is not None:
            write_kv_cache(k_p, v_p, cache, prefix_layout.slot_mapping)
        write_kv_cache(k_t, v_t, cache, layout.slot_mapping)
        if q_p is not None:
            out_p = _attend(q_p, cache, prefix_layout)
        return out_p, _attend(q_t, cache, layout)

    for block in model.blocks:
        prefix, target = block(prefix, target, cond, attend, row_ids)
    velocity = model.final_layer(target, cond, row_ids).float()

    offset = 0
    for scheduled in batch:
        job = scheduled.job
        height, width = job.request.height, job.request.width
        per_row = []
        for row in job.rows:
            tokens = velocity[offset : offset + row.target_len].unsqueeze(0)
            per_row.append(unpatchify(tokens, model.config.patch_size, height, width, model.config.in_channels)[0])
            offset += row.target_len
        guided = guided_velocity(per_row[0], per_row[1] if job.guided else None, job.request.guidance_scale)
        t, t_next = job.times[job.step_index], job.times[job.step_index + 1]
        job.latents = euler_step(job.latents, guided, t, t_next)
        job.step_index += 1
