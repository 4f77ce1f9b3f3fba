"""One request on several ranks: CFG-parallel rows and Ulysses sequence parallelism for the paged DiT forward.

The topology is a ``torch.distributed.device_mesh`` with the named dims ``("cfg", "sp")`` over all of WORLD
(``init_parallel``; SP innermost: ``rank = cfg_rank * sp + sp_rank``), and ``ParallelState`` is this rank's view of
its CFG and SP groups. Every rank holds the whole model and runs the same pipeline calls in the same order; each
call does only this rank's share of the work and ends with every rank holding every row's velocity, so every rank
advances every job identically (its own copy of the latents) and any rank can decode.

CFG-parallel (``cfg`` ranks, 1 or 2): the rows of a forward are dealt to the CFG ranks. A guided job's cond row
runs on CFG rank 0 and its uncond row on CFG rank 1; an unguided job's single row goes to the CFG rank holding
fewer tokens so far (ties to rank 0), so a lone unguided request runs on CFG rank 0 while rank 1 waits at the
final all-gather, and a batch of unguided requests spreads over both. After the forward the velocities are
all-gathered over the CFG group (``CFG combine``: every rank then applies guidance itself).

Ulysses SP (``sp`` ranks): inside one CFG rank's share, the flat token list of the forward (prefix tokens for
``write_prefix``, image tokens for a denoise step) is padded to a multiple of ``sp`` and cut into ``sp``
contiguous slices; each rank runs the per-token work (projections, norms, MLPs, modulation) on its slice only.
Attention needs every token: an all-to-all turns ``[tokens / sp, heads, size]`` into ``[tokens, heads / sp,
size]`` (this rank's head group), the paged attention runs over the full rows for those heads, and a second
all-to-all brings the output back to the token slice. Each rank's KV cache therefore holds only its head group
(``heads / sp`` heads: 1/sp of the KV memory); the final velocities are all-gathered over the SP group.
Invariant: ``num_heads % sp == 0`` (checked by ``check_sequence_parallel`` and ``enable_parallel``).

Layerwise offload in AllGather mode shards block weights over ``ParallelState.offload_group``, the SP group: its
ranks run every block of every forward together, as an AllGather needs. CFG ranks do not (a CFG rank with no rows
in a forward skips the blocks), so they never share a sharded weight.

Step caches (``job.step_cache``, CFG-parallel only for now): each CFG rank runs its rows' caches and takes every
job's decision from the changes summed over the ranks (one all-reduce per decision boundary), so a guided job's
cond row (rank 0) and uncond row (rank 1) decide together and every rank records the same decisions.

Outputs equal the single-rank forward up to floating-point reassociation in the per-token GEMMs (the attention
of each row and head sees exactly the same inputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from diffusion_kv import cdiv
from omni_models import paged
from omni_models.model import QKV, CausalPrefixDiT, JointAttention, patchify, unpatchify
from omni_models.runner import ScheduledJob

if TYPE_CHECKING:
    from diffusion_kv import AttentionCacheSpec
    from omni_models.pipeline import Pipeline

CFG_SIZES = (1, 2)
MESH_DIMS = ("cfg", "sp")
# torch 2.13 renamed all_gather_into_tensor; the GPU image's torch 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_sequence_parallel(num_heads: int, sequence_parallel_size: int) -> None:
    """ValueError unless the sequence-parallel size is >= 1 and divides the attention heads."""
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    if num_heads % sequence_parallel_size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} does not divide the model's {num_heads} attention "
            f"heads (Ulysses gives each rank heads/SP heads); use one of {divisors}"
        )


def check_cfg_parallel(cfg_parallel_size: int) -> None:
    if cfg_parallel_size not in CFG_SIZES:
        raise ValueError(f"cfg_parallel_size must be 1 or 2 (one rank per CFG branch), got {cfg_parallel_size}")


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the CFG and SP groups (``*_group`` None when that dimension has one rank)."""

    cfg_size: int = 1
    cfg_rank: int = 0
    cfg_group: dist.ProcessGroup | None = None
    sp_size: int = 1
    sp_rank: int = 0
    sp_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.cfg_size * self.sp_size

    @property
    def offload_group(self) -> dist.ProcessGroup | None:
        """The group a layerwise offload shards block weights over (``dlo_offload``'s ``group``): SP, whose ranks
        run every block of every forward together; None with one SP rank (see the module docstring)."""
        return self.sp_group

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelState:
        """This rank's view of a mesh with the dims ``MESH_DIMS``."""
        cfg, sp = mesh["cfg"], mesh["sp"]
        return cls(
            cfg_size=cfg.size(),
            cfg_rank=cfg.get_local_rank(),
            cfg_group=cfg.get_group() if cfg.size() > 1 else None,
            sp_size=sp.size(),
            sp_rank=sp.get_local_rank(),
            sp_group=sp.get_group() if sp.size() > 1 else None,
        )


def init_parallel(*, cfg_parallel_size: int = 1, sequence_parallel_size: int = 1) -> ParallelState:
    """Build the ``("cfg", "sp")`` device mesh over WORLD and return this rank's ``ParallelState``.

    A collective: ``torch.distributed`` must be initialized and WORLD must be exactly ``cfg x sp`` ranks (every rank
    serves each request). The mesh's device type follows WORLD's backend (NCCL: ``cuda``, else ``cpu``); its groups
    live as long as WORLD and ``torch.distributed.destroy_process_group()`` tears them down with it.
    """
    check_cfg_parallel(cfg_parallel_size)
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before init_parallel builds the device mesh")
    world = dist.get_world_size()
    if world != cfg_parallel_size * sequence_parallel_size:
        raise ValueError(
            f"WORLD has {world} ranks but cfg_parallel_size x sequence_parallel_size is {cfg_parallel_size} x "
            f"{sequence_parallel_size} = {cfg_parallel_size * sequence_parallel_size}; start that many ranks"
        )
    device_type = "cuda" if dist.get_backend() == dist.Backend.NCCL else "cpu"
    mesh = init_device_mesh(device_type, (cfg_parallel_size, sequence_parallel_size), mesh_dim_names=MESH_DIMS)
    return ParallelState.from_mesh(mesh)


def shard_kv_specs(specs: Sequence[AttentionCacheSpec], sp_size: int) -> tuple[AttentionCacheSpec, ...]:
    """The per-rank cache specs under Ulysses: each rank stores ``heads / sp`` heads of every layer."""
    for spec in specs:
        check_sequence_parallel(spec.num_kv_heads, sp_size)
    return tuple(dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // sp_size) for spec in specs)


def enable_parallel(pipeline: Pipeline, state: ParallelState) -> None:
    """Run ``pipeline``'s paged forwards (engine steps and ``__call__``) as this rank's share.

    Call it before any KV cache is allocated: the caches it allocates afterwards hold this rank's head group.
    """
    if pipeline.kv_caches:
        raise RuntimeError("enable_parallel must run before allocate_kv_caches: the caches hold heads / SP heads")
    if pipeline.attention_backend != "paged":
        raise ValueError("CFG-parallel and sequence parallelism run the paged forward; use attention_backend='paged'")
    if pipeline.cuda_graphs:
        raise ValueError("cuda_graphs=True cannot capture the forward's collectives; load without CUDA graphs")
    check_sequence_parallel(pipeline.model.config.num_heads, state.sp_size)
    pipeline._kv_layers = shard_kv_specs(pipeline._kv_layers, state.sp_size)
    pipeline.parallel = state


# -- row assignment --------------------------------------------------------------------------------------------


def assign_rows(rows: Sequence[paged.RowRef], cfg_size: int) -> list[list[int]]:
    """Indices into ``rows`` for each CFG rank (see the module docstring); deterministic on every rank."""
    if cfg_size == 1:
        return [list(range(len(rows)))]
    shares: list[list[int]] = [[] for _ in range(cfg_size)]
    load = [0] * cfg_size
    for index, ref in enumerate(rows):
        if ref.job.guided:
            rank = 0 if ref.row.role == "cond" else 1
        else:
            rank = min(range(cfg_size), key=lambda r: (load[r], r))
        shares[rank].append(index)
        load[rank] += ref.row.target_len
    return shares


# -- Ulysses ---------------------------------------------------------------------------------------------------


def _tokens_to_heads(qkv: QKV, state: ParallelState) -> QKV:
    """q, k, v ``[T / sp, H, D]`` on each rank -> ``[T, H / sp, D]`` (every token of this rank's head group), in one
    all-to-all for the three."""
    sp = state.sp_size
    tokens, heads, size = qkv.query.shape
    stacked = torch.stack(tuple(qkv), dim=1)  # [T / sp, 3, H, D]
    send = stacked.reshape(tokens, 3, sp, heads // sp, size).permute(2, 0, 1, 3, 4).contiguous()  # j -> rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=state.sp_group)  # received[i]: rank i's tokens, my heads
    return QKV(*received.reshape(sp * tokens, 3, heads // sp, size).unbind(1))


def _heads_to_tokens(x: Tensor, state: ParallelState) -> Tensor:
    """Inverse of ``_tokens_to_heads``: ``[T, H / sp, D]`` -> this rank's ``[T / sp, H, D]``."""
    sp = state.sp_size
    total, heads, size = x.shape
    send = x.reshape(sp, total // sp, heads, size).contiguous()  # token slice i goes back to rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=state.sp_group)  # received[j]: my tokens, head group j
    return received.permute(1, 0, 2, 3).reshape(total // sp, sp * heads, size)


@dataclass(frozen=True)
class _Split:
    """How a flat token list of ``total`` tokens is cut into ``sp`` padded slices."""

    total: int
    sp_size: int
    sp_rank: int

    @property
    def local(self) -> int:
        return cdiv(self.total, self.sp_size)

    def slice(self, x: Tensor) -> Tensor:
        """This rank's slice of ``x`` (first dim = tokens), zero-padded past the end."""
        padded = self.local * self.sp_size
        if padded != x.shape[0]:
            x = torch.cat([x, x.new_zeros((padded - x.shape[0], *x.shape[1:]))])
        return x[self.sp_rank * self.local : (self.sp_rank + 1) * self.local]

    def full(self, x: Tensor) -> Tensor:
        """``[local * sp, ...]`` gathered in rank order -> the ``total`` real tokens."""
        return x[: self.total]

    def pad(self, x: Tensor) -> Tensor:
        padded = self.local * self.sp_size
        return x if padded == x.shape[0] else torch.cat([x, x.new_zeros((padded - x.shape[0], *x.shape[1:]))])


class _UlyssesAttention:
    """An ``attend`` that runs the inner (paged) attention over all tokens of this rank's head group."""

    def __init__(
        self, inner: paged._LayerAttention, state: ParallelState, prefix: _Split | None, target: _Split | None
    ) -> None:
        self.inner, self.state, self.splits = inner, state, (prefix, target)

    def _gather(self, qkv: QKV | None, split: _Split | None) -> QKV | None:
        if qkv is None:
            return None
        return QKV(*(split.full(x) for x in _tokens_to_heads(qkv, self.state)))

    def __call__(self, attn: JointAttention, prefix: QKV | None, target: QKV | None):
        out_prefix, out_target = self.inner(
            attn, self._gather(prefix, self.splits[0]), self._gather(target, self.splits[1])
        )
        outs = []
        for out, split in zip((out_prefix, out_target), self.splits, strict=True):
            outs.append(None if out is None else _heads_to_tokens(split.pad(out), self.state))
        return tuple(outs)


def _sp_gather(x: Tensor, split: _Split, state: ParallelState) -> Tensor:
    """Every rank's ``[local, ...]`` slice -> the full ``[total, ...]`` on every rank of the SP group."""
    if state.sp_size == 1:
        return x[: split.total]
    out = torch.empty((split.local * state.sp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x.contiguous(), group=state.sp_group)
    return split.full(out)


def _cfg_gather(local: Tensor, sizes: Sequence[int], state: ParallelState) -> list[Tensor]:
    """Each CFG rank's flat ``[sizes[r], ...]`` rows -> all of them, on every rank (padded all-gather)."""
    if state.cfg_size == 1:
        return [local]
    longest = max(max(sizes), 1)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((longest * state.cfg_size, *local.shape[1:]))
    _all_gather(out, padded, group=state.cfg_group)
    return [out[r * longest : r * longest + size] for r, size in enumerate(sizes)]


# -- forwards ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def write_prefix(
    model: CausalPrefixDiT, kv: paged.PagedKV, batch: Sequence[ScheduledJob], state: ParallelState
) -> None:
    """``paged.write_prefix`` as this rank's share: its CFG rows, its token slice, its head group's K/V."""
    paged._check_jobs(batch, denoise=False)
    rows = paged.batch_rows(batch)
    mine = [rows[i] for i in assign_rows(rows, state.cfg_size)[state.cfg_rank]]
    if mine:
        inputs = paged.prefix_inputs(model, mine, kv)
        split = _Split(inputs.shape[0], state.sp_size, state.sp_rank)
        inner = paged._LayerAttention(kv, paged.prefix_batch(kv, mine), None)
        attend = inner if state.sp_size == 1 else _UlyssesAttention(inner, state, split, None)
        prefix = split.slice(inputs)
        for block in model.blocks:
            prefix, _ = block(prefix, None, None, attend)
    for scheduled in batch:
        scheduled.job.prefix_written = True


def _local_velocity(
    model: CausalPrefixDiT,
    kv: paged.PagedKV,
    rows: Sequence[paged.RowRef],
    state: ParallelState,
    cached: list | None = None,
) -> Tensor:
    """Float32 velocity ``[target tokens of rows, patch_dim]`` of this CFG rank's rows (SP-split inside).

    ``cached``: the step caches of the whole batch's jobs; this rank runs its rows' caches and takes every job's
    decision from the changes summed over the CFG ranks (one rank, so no SP split: refused at ``prepare``)."""
    plan = paged.target_plan(model, kv, rows, recompute_prefix=False)
    patches = torch.cat([patchify(ref.job.latents.unsqueeze(0), model.config.patch_size)[0] for ref in rows])
    times = torch.tensor([ref.job.times[ref.job.step_index] for ref in rows], device=kv.device)
    if cached:
        from omni_models.step_cache_blocks import all_reduce_sum

        assert state.sp_size == 1, "the DiT's step cache runs without sequence parallelism"
        return paged._cached_velocity(
            model, kv, rows, plan, patches.to(kv.dtype), times, reduce=all_reduce_sum(), jobs=cached
        )
    split = _Split(patches.shape[0], state.sp_size, state.sp_rank)
    attend = plan.attend if state.sp_size == 1 else _UlyssesAttention(plan.attend, state, None, split)
    row_ids = split.slice(plan.row_ids)
    target = model.embed_target(split.slice(patches.to(kv.dtype)), split.slice(plan.positions))
    cond = model.timestep_condition(times).to(kv.dtype)
    for block in model.blocks:
        _, target = block(None, target, cond, attend, row_ids)
    return _sp_gather(model.final_layer(target, cond, row_ids).float(), split, state)


@torch.no_grad()
def predict_velocities(
    model: CausalPrefixDiT, kv: paged.PagedKV, batch: Sequence[ScheduledJob], state: ParallelState
) -> list[list[Tensor]]:
    """``paged.predict_velocities`` over the ranks: every rank returns every row's velocity."""
    paged._check_jobs(batch, denoise=True)
    rows = paged.batch_rows(batch)
    shares = assign_rows(rows, state.cfg_size)
    mine = [rows[i] for i in shares[state.cfg_rank]]
    config = model.config
    cached = paged.cached_jobs(batch)
    if mine:
        local = _local_velocity(model, kv, mine, state, cached)
    else:
        if cached:  # no rows here: take part in the decisions all the same
            from omni_models.step_cache_blocks import CachedForward, all_reduce_sum

            CachedForward([], len(model.blocks), None, reduce=all_reduce_sum(), jobs=cached, device=kv.device).idle()
        local = torch.empty((0, config.patch_dim), dtype=torch.float32, device=kv.device)
    sizes = [sum(rows[i].row.target_len for i in share) for share in shares]
    gathered = _cfg_gather(local, sizes, state)
    velocities: list[Tensor | None] = [None] * len(rows)
    for share, flat in zip(shares, gathered, strict=True):
        offset = 0
        for i in share:
            ref = rows[i]
            tokens = flat[offset : offset + ref.row.target_len].unsqueeze(0)
            velocities[i] = unpatchify(
                tokens, config.patch_size, ref.job.request.height, ref.job.request.width, config.in_channels
            )[0]
            offset += ref.row.target_len
    per_job, index = [], 0
    for scheduled in batch:
        per_job.append(velocities[index : index + len(scheduled.job.rows)])
        index += len(scheduled.job.rows)
    return per_job


def denoise_step(
    model: CausalPrefixDiT, kv: paged.PagedKV, batch: Sequence[ScheduledJob], state: ParallelState
) -> None:
    """One guided Euler step for every job, on every rank alike."""
    for scheduled, row_velocities in zip(batch, predict_velocities(model, kv, batch, state), strict=True):
        scheduled.job.advance(row_velocities)
