"""Parallel-state rules: DP inference, rank layout, DLO group choice, atomic group setup.

Rank order is ``tp-sp-pp-cfg-dp``, innermost first:
``global = tp_i + tp * (sp_i + sp * (pp_i + pp * (cfg_i + cfg * dp_i)))``. DP is what
is left of WORLD after the other dimensions. The DLO group that shards host
weights is the DP group when DP > 1, else the SP group; tensor parallelism never
is. Group setup is all-or-nothing: a failure destroys every group created so far.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_ORDER = "tp-sp-pp-cfg-dp"
_DIMENSIONS = ("tp", "sp", "pp", "cfg", "dp")


def resolve_data_parallel_size(
    world_size: int,
    *,
    tensor_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    cfg_parallel_size: int = 1,
    data_parallel_size: int | None = None,
    use_hsdp: bool = False,
    hsdp_replicate_size: int = 1,
    hsdp_shard_size: int = 1,
) -> int:
    """The data-parallel size WORLD implies; an explicit value must agree with it."""
    if world_size <= 0:
        raise ValueError(f"WORLD size must be > 0, but got {world_size}")
    if use_hsdp:
        if data_parallel_size not in (None, 1):
            raise ValueError(
                f"HSDP (FSDP2) requires data_parallel_size to be 1 (or omitted), got {data_parallel_size}"
            )
        expected = hsdp_replicate_size * hsdp_shard_size
        if world_size != expected:
            raise ValueError(
                f"WORLD size ({world_size}) must equal HSDP size "
                f"({hsdp_replicate_size} x {hsdp_shard_size} = {expected})"
            )
        return 1
    non_dp = tensor_parallel_size * sequence_parallel_size * pipeline_parallel_size * cfg_parallel_size
    if non_dp <= 0 or world_size % non_dp:
        raise ValueError(f"WORLD size ({world_size}) must be divisible by non-DP parallel size ({non_dp})")
    inferred = world_size // non_dp
    if data_parallel_size is not None and data_parallel_size != inferred:
        raise ValueError(f"data_parallel_size ({data_parallel_size}) does not match WORLD-derived value ({inferred})")
    return inferred


def dlo_group_size(
    *,
    data_parallel_size: int | None = None,
    sequence_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    use_allgather: bool = True,
    resident_layers: int = 0,
    use_hsdp: bool = False,
    hsdp_shard_size: int = 0,
    hsdp_replicate_size: int = 1,
) -> int:
    """Size G of the group that shards host weights (1 means no weight collective).

    DP when > 1, else SP; HSDP shard x replicate when HSDP is on; never TP.
    `tensor_parallel_size` is accepted so callers can pass their whole config and
    see that it does not contribute.
    """
    if resident_layers < 0:
        raise ValueError(f"resident_layers must be >= 0, got {resident_layers}")
    if resident_layers > 0 and use_allgather:
        raise ValueError(
            f"resident_layers={resident_layers} requires use_allgather=False: resident blocks keep the weights "
            "the model's own loader put on each rank"
        )
    if use_hsdp and use_allgather:
        raise ValueError(
            "Distributed layerwise offload with AllGather is incompatible with HSDP: HSDP parameters are "
            "already sharded DTensors, and the offloader would double-shard them. Pass use_allgather=False "
            "(rank-local weights from the model's own loader) or use_hsdp=False."
        )
    if not use_allgather:
        logger.info(
            "Distributed layerwise offload: use_allgather=False, streaming complete rank-local blocks "
            "(no weight shard or AllGather); each rank keeps its own host copy"
        )
        return 1
    size = data_parallel_size or 1
    if size <= 1 and sequence_parallel_size > 1:
        size = sequence_parallel_size
    return size


def _decompose(index: int, sizes: list[int]) -> list[int]:
    digits = []
    for size in sizes:
        digits.append(index % size)
        index //= size
    return digits


def masked_orthogonal_rank_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Rank groups varying the masked dimensions, one group per unmasked coordinate."""
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    masked = [s for s, m in zip(sizes, mask) if m]
    unmasked = [s for s, m in zip(sizes, mask) if not m]
    groups = []
    for outer in range(math.prod(unmasked)):
        outer_digits = iter(_decompose(outer, unmasked))
        fixed = [0 if m else next(outer_digits) for m in mask]
        ranks = []
        for inner in range(math.prod(masked)):
            inner_digits = iter(_decompose(inner, masked))
            coords = [next(inner_digits) if m else f for m, f in zip(mask, fixed)]
            ranks.append(sum(c * s for c, s in zip(coords, strides)))
        groups.append(ranks)
    return groups


@dataclass(frozen=True)
class RankGenerator:
    """Rank groups for each parallel dimension (or a ``-``-joined set of dimensions)."""

    tp: int
    sp: int
    pp: int
    cfg: int
    dp: int
    order: str = DEFAULT_ORDER
    rank_offset: int = 0

    def __post_init__(self) -> None:
        names = self.order.split("-")
        for name in _DIMENSIONS:
            if getattr(self, name) != 1 and name not in names:
                raise RuntimeError(
                    f"parallel size {name}={getattr(self, name)} is not 1 but {name!r} is missing from "
                    f"order {self.order!r}"
                )
        unknown = [n for n in names if n not in _DIMENSIONS]
        if unknown:
            raise RuntimeError(f"order {self.order!r} names unknown dimensions {unknown}; use {_DIMENSIONS}")

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.pp * self.cfg * self.dp

    def get_ranks(self, token: str) -> list[list[int]]:
        names = self.order.split("-")
        wanted = token.split("-")
        unknown = [w for w in wanted if w not in names]
        if unknown:
            raise ValueError(f"token {token!r} names dimensions {unknown} that are not in order {self.order!r}")
        sizes = [getattr(self, n) for n in names]
        groups = masked_orthogonal_rank_groups(sizes, [n in wanted for n in names])
        return [[r + self.rank_offset for r in group] for group in groups]


@dataclass
class GroupHandle:
    """This rank's group for one dimension."""

    ranks: list[int]
    group: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass
class ModelParallelGroups:
    sizes: dict[str, int]
    groups: dict[str, GroupHandle] = field(default_factory=dict)
    created: list[dist.ProcessGroup] = field(default_factory=list)

    def __getitem__(self, name: str) -> GroupHandle:
        return self.groups[name]


_STATE: ModelParallelGroups | None = None


def initialize_model_parallel(
    *,
    tensor_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    cfg_parallel_size: int = 1,
    data_parallel_size: int | None = None,
    backend: str | None = None,
) -> ModelParallelGroups:
    """Create every rank group on all ranks (a collective), or none of them."""
    global _STATE
    if _STATE is not None:
        found = ", ".join(name for name, h in _STATE.groups.items() if h.world_size > 1) or "all groups"
        raise RuntimeError(
            f"model parallel state must be empty before initialization; found {found}: model parallel groups "
            "are already initialized, call destroy_model_parallel() first"
        )
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before model parallel initialization")
    world = dist.get_world_size()
    dp = resolve_data_parallel_size(
        world,
        tensor_parallel_size=tensor_parallel_size,
        sequence_parallel_size=sequence_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        cfg_parallel_size=cfg_parallel_size,
        data_parallel_size=data_parallel_size,
    )
    generator = RankGenerator(
        tensor_parallel_size, sequence_parallel_size, pipeline_parallel_size, cfg_parallel_size, dp
    )
    state = ModelParallelGroups(sizes={"tp": generator.tp, "sp": generator.sp, "pp": generator.pp,
                                       "cfg": generator.cfg, "dp": generator.dp})
    me = dist.get_rank()
    try:
        for name in ("dp", "cfg", "pp", "sp", "tp"):
            for ranks in generator.get_ranks(name):
                group = dist.new_group(ranks, backend=backend)
                state.created.append(group)
                if me in ranks:
                    state.groups[name] = GroupHandle(ranks, group)
    except BaseException:
        _destroy(state)
        raise
    _STATE = state
    return state


def _destroy(state: ModelParallelGroups) -> None:
    for group in reversed(state.created):
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    state.created.clear()
    state.groups.clear()


def destroy_model_parallel() -> None:
    """Destroy every group `initialize_model_parallel` created; a no-op when there are none."""
    global _STATE
    if _STATE is not None:
        state, _STATE = _STATE, None
        _destroy(state)


def get_model_parallel_groups() -> ModelParallelGroups:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel() first")
    return _STATE


def select_dlo_group(groups: ModelParallelGroups, *, use_allgather: bool = True) -> dist.ProcessGroup | None:
    """The DLO sharding group: DP when it has > 1 rank, else SP, else None. Never TP."""
    if not use_allgather:
        return None
    dp, sp = groups["dp"], groups["sp"]
    if dp.world_size > 1:
        return dp.group
    if sp.world_size > 1:
        logger.info("Distributed layerwise offload: DP=1, using SP group (world_size=%d) for weight sharding", sp.world_size)
        return sp.group
    logger.info("Distributed layerwise offload: dp_size=1, running without AllGather")
    return None
