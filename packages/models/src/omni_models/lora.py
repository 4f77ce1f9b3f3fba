"""Unmerged LoRA served per request: rows of one batched forward each use their own adapter (or none).

The base weights are never touched (bf16, FP8 linears from ``fp8_cache``, or blocks streamed by ``dlo_offload``):
each target linear gets a forward hook that adds ``scale[row] * (x @ A[slot]^T) @ B[slot]^T`` to its output, row by
row (Punica's SGMV applied to the rows of a DiT batch: a row is one image's cond or uncond pass, so a segment is a
whole row). Two ways to add it:

- the row path (torch ops; on the CPU, and what a compiled graph traces by default, ``compiled_path="torch"``):
  ``rows()`` gathers every row's adapter, all target linears at once, in one copy per row and forward (``row_down
  [rows, ...]``, ``row_up`` with the row's scale folded in), so each linear adds its delta with two batched matmuls on
  views of that copy (``bmm`` for the shrink and for the expand, whose add a compiled graph fuses into the next op): no
  gather or scale kernel per linear. Linears that project one input (an attention's Q/K/V, FLUX's single-stream
  MLP beside them: ``SHARED_INPUT_GROUPS``) lie side by side in the copy and shrink together, one ``bmm`` of
  ``x`` against all their A factors, each taking its slice. The copy holds ``rows x`` one slot's bytes for the
  forward;
- the Triton pair (eager on CUDA; ``compiled_path="kernels"`` puts it in a graph as one opaque op): a shrink and an
  expand kernel per linear that read the slots in place and skip the rows without an adapter.

``compiled_path="reference"`` traces ``lora_delta_reference`` (a gather of the slot weights per linear, the path
before the row copy), for the benchmark's comparison.

Invariants:
- Fixed shapes. Every target linear owns ``max_loras`` device slots (``A: [max_loras, R, in]``, ``B:
  [max_loras, out, R]``, views into two flat buffers of all targets, allocated once), rank zero-padded to ``R``
  (``padded_rank(max_rank)``); loading an adapter copies into a slot in place (``B`` times the layer's scaling), so
  switching or mixing adapters never changes a shape the compiled graph sees. The per-forward row table
  (``LoRARows``: slot index, -1 for none, scale per row, the row copy) is a tensor input.
- Two graphs, not one: a forward where no row has an adapter runs the base model (no LoRA op, eager or compiled),
  so a compiled block has a graph with the LoRA ops and one without; an engine warms both (``warming()``).
- Exactness of "none": a row without an adapter gets exactly the base output (the kernel skips it; the row path
  copies a zero slot, and ``y + 0 @ 0`` is ``y``; the reference adds ``0 *`` a finite delta).
- Two LRUs: adapters live in at most ``max_loras`` device slots and ``max_cpu_loras`` host copies; a registered
  adapter evicted from both is read from its file again when used. A forward needs every adapter of its rows in a
  slot at once, so ``partition`` splits a batch into forwards of at most ``max_loras`` distinct adapters: more
  adapters than slots is slower, never an error.
- A job holds its ``LoRAAdapter`` until it is released, so unregistering a name only stops new requests.

Pure torch: reading adapter files (diffusers/PEFT and kohya layouts, through diffusers' own converters) is
``omni_models.lora_files``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from omni_models.errors import CheckpointError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
CompiledPath = Literal["torch", "kernels", "reference"]
COMPILED_PATHS = ("torch", "kernels", "reference")
MIN_PADDED_RANK = 16  # tl.dot needs at least 16 along every dimension

# Sibling linears that diffusers' attention processors and blocks call on one tensor (relative names, the largest
# first): the row path shrinks each group's input once. A member called on another tensor shrinks it anew, so a
# wrong guess costs time, never correctness.
SHARED_INPUT_GROUPS = (
    ("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"),  # FLUX.1's single-stream blocks: one normed input
    ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"),
)


class LoRAError(CheckpointError):
    """A LoRA adapter file that cannot serve this model (``str(error)``: the file, then the problem)."""


@dataclass(frozen=True)
class LoRAOptions:
    """How many adapters a pipeline holds: ``max_loras`` device slots, ``max_cpu_loras`` host copies (default:
    ``max_loras``), ranks up to ``max_rank``."""

    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): an adapter in a "
                "device slot keeps its host copy"
            )

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def padded_rank(max_rank: int) -> int:
    """The rank every slot holds: ``max_rank`` rounded up to a power of two, at least ``MIN_PADDED_RANK``."""
    return max(MIN_PADDED_RANK, 1 << (max_rank - 1).bit_length())


@dataclass(frozen=True)
class LoRALayer:
    """One linear's factors as the file holds them: ``down`` (A) ``[r, in]``, ``up`` (B) ``[out, r]``, and
    ``scaling`` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA), applied at run time in float32."""

    down: Tensor
    up: Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class LoRAWeights:
    """Every layer of one adapter, by the transformer's module name (host tensors in the model's dtype)."""

    layers: Mapping[str, LoRALayer]

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.down, layer.up))


@dataclass(eq=False)
class LoRAAdapter:
    """A registered adapter: its name, its file, what it holds. Identity is the object (a name loaded again is
    another adapter), so a slot never serves stale weights."""

    name: str
    path: Path
    rank: int
    num_layers: int
    nbytes: int
    load_s: float  # reading the file and converting it, the first time
    layers: frozenset[str]  # the linears it holds layers for


@dataclass(frozen=True)
class LoRARows:
    """The row table of one forward: ``slots`` int32 ``[rows]`` (-1: no adapter) and ``scales`` float32 ``[rows]``
    on the device; ``any_adapter``: some row has one (host-side: a forward without runs the base model alone).
    The row path reads each target's ``row_down`` / ``row_up`` instead (``rows()`` copies them)."""

    slots: Tensor
    scales: Tensor
    any_adapter: bool = True

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]


# --- the op ----------------------------------------------------------------------------------------------------


def triton_interpreter_active() -> bool:
    module = sys.modules.get("omni_models._lora_triton")
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels():
    try:
        from omni_models import _lora_triton
    except ImportError:
        return None
    return _lora_triton


def use_triton(backend: Backend, device: torch.device) -> bool:
    """Whether ``backend`` runs the Triton kernels on ``device`` ("auto": on CUDA when Triton imports); decided
    once, outside any compiled region."""
    if backend == "torch":
        return False
    if backend == "triton":
        if device.type != "cuda" and not triton_interpreter_active():
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "omni_models._lora_triton is imported, or use backend='torch'"
            )
        if _kernels() is None:
            raise ValueError("backend='triton' needs Triton, which is not importable here")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return device.type == "cuda" and _kernels() is not None


def lora_delta_reference(x: Tensor, down: Tensor, up: Tensor, scaling: Tensor, slots: Tensor, scales: Tensor) -> Tensor:
    """The semantics: ``[B, S, out]`` with row ``b`` = ``scales[b] * scaling[s] * (x[b] @ down[s]^T) @ up[s]^T``
    for ``s = slots[b]``, zero where ``s < 0``. ``x``: ``[B, S, in]``; ``down`` ``[L, R, in]``; ``up`` ``[L, out,
    R]``; ``scaling`` float32 ``[L]``. Matmuls in ``x``'s dtype, as PEFT's ``lora_B(lora_A(x)) * scaling``."""
    active = slots >= 0
    index = slots.clamp_min(0).long()
    shrunk = torch.bmm(x, down[index].transpose(1, 2))
    expanded = torch.bmm(shrunk, up[index].transpose(1, 2))
    factor = torch.where(active, scales * scaling[index], torch.zeros_like(scales))
    return expanded * factor.to(expanded.dtype)[:, None, None]


# The kernels as one opaque op that updates ``y`` in place, so ``torch.compile`` keeps the served graph whole
# (no graph break) whatever launches them (compiled Triton on CUDA, the interpreter in CPU tests).
@torch.library.custom_op("omni_models::lora_shrink_expand", mutates_args=("y",))
def _lora_shrink_expand(
    y: Tensor, x: Tensor, down: Tensor, up: Tensor, scaling: Tensor, slots: Tensor, scales: Tensor
) -> None:
    _kernels().lora_shrink_expand(y.view(x.shape[0], -1, y.shape[-1]), x, down, up, scaling, slots, scales)


@_lora_shrink_expand.register_fake
def _(y: Tensor, x: Tensor, down: Tensor, up: Tensor, scaling: Tensor, slots: Tensor, scales: Tensor) -> None:
    return None


def _check_rows(x: Tensor, rows: LoRARows) -> int:
    """``x``'s row count, which must be the row table's (a target's leading dimension is the batch of rows)."""
    batch = x.shape[0]
    if batch != rows.num_rows:
        raise ValueError(
            f"a LoRA target got {batch} rows but the forward's row table has {rows.num_rows}: the module's leading "
            "dimension is not the batch of rows"
        )
    return batch


def lora_add(
    y: Tensor,
    x: Tensor,
    down: Tensor,
    up: Tensor,
    scaling: Tensor,
    rows: LoRARows,
    *,
    triton: bool,
) -> Tensor:
    """``y`` (a linear's output ``[B, ..., out]`` for input ``x`` ``[B, ..., in]``) plus each row's LoRA delta
    (``lora_delta_reference``). ``triton`` (``use_triton``): the kernels add in place and return ``y``; else the
    reference returns a new tensor."""
    batch = _check_rows(x, rows)
    x3 = x.reshape(batch, -1, x.shape[-1])
    if triton:
        _lora_shrink_expand(y, x3.contiguous(), down, up, scaling, rows.slots, rows.scales)
        return y
    delta = lora_delta_reference(x3, down, up, scaling, rows.slots, rows.scales)
    return y + delta.view(y.shape).to(y.dtype)


# --- slots and hooks -------------------------------------------------------------------------------------------


class TargetSlots:
    """One target linear's part of the runtime's slot buffers: ``down [L, R, in]`` and ``up [L, out, R]`` (views of
    the flat buffers ``[L + 1, ...]``, whose last slot stays zero), and where its factors sit in a row of them (the
    row path slices its own out of the forward's row copy)."""

    def __init__(
        self,
        down_flat: Tensor,
        up_flat: Tensor,
        offsets: tuple[int, int],
        in_features: int,
        out_features: int,
        *,
        num_slots: int,
        rank: int,
    ) -> None:
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down_offset, self.up_offset = offsets
        self.down = self._span(down_flat[:num_slots], self.down_offset, rank, in_features)
        self.up = self._span(up_flat[:num_slots], self.up_offset, out_features, rank)
        self.row_down: Tensor | None = None  # the row path's factors of this forward (``view_rows``)
        self.row_up: Tensor | None = None
        self.group: SharedShrink | None = None  # linears sharing this one's input, and its place among them
        self.member = 0

    @staticmethod
    def _span(flat: Tensor, offset: int, rows: int, cols: int) -> Tensor:
        return flat[:, offset : offset + rows * cols].view(flat.shape[0], rows, cols)

    def view_rows(self, down_rows: Tensor, up_rows: Tensor) -> None:
        """Point ``row_down [rows, R, in]`` and ``row_up [rows, out, R]`` at this linear's factors in a row copy
        (``[rows, all targets' A]``, ``[rows, all targets' B]``). Tensor attributes, not offsets: a compiled block
        reads them as inputs, so every block of a class shares one graph."""
        self.row_down = self._span(down_rows, self.down_offset, self.rank, self.in_features)
        self.row_up = self._span(up_rows, self.up_offset, self.out_features, self.rank)

    def write(self, slot: int, layer: LoRALayer | None) -> None:
        """Slot ``slot`` holds ``layer`` (zero-padded to the slot rank; ``up`` times the layer's scaling), or
        nothing (``None``: a zero delta)."""
        if layer is None:
            self.down[slot].zero_()
            self.up[slot].zero_()
            return
        r = layer.rank
        self.down[slot, :r].copy_(layer.down, non_blocking=True)
        self.down[slot, r:].zero_()
        self.up[slot, :, :r].copy_(layer.up, non_blocking=True)
        if layer.scaling != 1.0:
            self.up[slot, :, :r].mul_(layer.scaling)
        self.up[slot, :, r:].zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.down, self.up))


def lora_add_rows(y: Tensor, x: Tensor, down_rows: Tensor, up_rows: Tensor) -> Tensor:
    """The row path: ``y`` (``[B, ..., out]``) plus each row's delta, ``(x @ down_rows^T) @ up_rows^T`` with
    ``down_rows [B, R, in]`` and ``up_rows [B, out, R]`` (each row's slot, its scale folded into ``up_rows``; a row
    without an adapter copied the zero slot). Two batched matmuls and an add, which a compiled graph fuses into the
    op that reads ``y`` next (``baddbmm`` would write ``y`` once more instead: 1.215x the base step for one
    adapter on the H200, 2026-12-02g)."""
    batch = x.shape[0]
    shrunk = torch.bmm(x.reshape(batch, -1, x.shape[-1]), down_rows.transpose(1, 2))
    return y + torch.bmm(shrunk, up_rows.transpose(1, 2)).view(y.shape)


class SharedShrink:
    """Linears that take one input, laid side by side in the row copy: the first of them a forward calls shrinks
    ``x`` against all their A factors at once (``row_down [rows, members x R, in]``), and the members of a run of
    equal output widths (Q/K/V) expand together, one ``bmm`` over the run's B factors (``row_up``, side by side as
    well); each member adds its own slice. What one member computed is kept only until every member has read it
    (``pending``), or until ``rows()`` ends; a member called on another tensor shrinks and expands that anew.
    ``delta`` reads only what every block's group of one class holds alike (``members``, ``rank``, ``runs``, the
    tensors), never ``names``: dynamo guards on each attribute a compiled block reads, and a guard on the names would
    compile the block class once per block, until dynamo's recompile limit sends the rest to eager."""

    def __init__(self, names: Sequence[str], rank: int, out_features: Sequence[int]) -> None:
        self.names, self.rank = tuple(names), rank
        self.members = len(self.names)
        self.out_features = tuple(out_features)
        runs, run_of = [], []  # (first member, count) of each run of equal output widths; each member's run
        for member, out in enumerate(self.out_features):
            if member == 0 or out != self.out_features[member - 1]:
                runs.append((member, 0))
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            run_of.append(len(runs) - 1)
        self.runs, self.run_of = tuple(runs), tuple(run_of)
        self.row_down: Tensor | None = None
        self.run_up: list[Tensor | None] = [None] * len(self.runs)  # [rows, count, out, R] of each run
        self.clear()

    def clear(self) -> None:
        self.input: Tensor | None = None
        self.shrunk: Tensor | None = None
        self.expanded: list[Tensor | None] = [None] * len(self.runs)
        self.pending = 0

    def view_rows(self, down_rows: Tensor, up_rows: Tensor, offsets: tuple[int, int], in_features: int) -> None:
        down_offset, up_offset = offsets
        self.row_down = TargetSlots._span(down_rows, down_offset, self.members * self.rank, in_features)
        for run, (first, count) in enumerate(self.runs):
            out = self.out_features[first]
            offset = up_offset + self.rank * sum(self.out_features[:first])
            span = TargetSlots._span(up_rows, offset, count * out, self.rank)
            self.run_up[run] = span.view(span.shape[0], count, out, self.rank)

    def delta(self, x: Tensor, member: int) -> Tensor:
        """Member ``member``'s LoRA delta of ``x`` (``[rows, S, out]``), from its run's shared expand."""
        self._shrink(x)
        run = self.run_of[member]
        first, count = self.runs[run]
        if self.expanded[run] is None:
            batch, tokens = self.shrunk.shape[0], self.shrunk.shape[1]
            shrunk = self.shrunk[..., first * self.rank : (first + count) * self.rank]
            shrunk = shrunk.reshape(batch, tokens, count, self.rank).transpose(1, 2).reshape(-1, tokens, self.rank)
            up = self.run_up[run].reshape(-1, self.out_features[first], self.rank)
            self.expanded[run] = torch.bmm(shrunk, up.transpose(1, 2)).view(batch, count, tokens, -1)
        return self._read(self.expanded[run][:, member - first])

    def _shrink(self, x: Tensor) -> None:
        if self.input is not x:  # the first member of this forward, or one called on another tensor
            batch = x.shape[0]
            self.clear()
            self.input = x
            self.shrunk = torch.bmm(x.reshape(batch, -1, x.shape[-1]), self.row_down.transpose(1, 2))
            self.pending = self.members

    def _read(self, result: Tensor) -> Tensor:
        self.pending -= 1
        if self.pending == 0:  # every member has read it: a compiled block keeps nothing past its graph
            self.clear()
        return result


def shared_input_groups(names: Sequence[str], in_features: Mapping[str, int]) -> list[list[str]]:
    """The groups of ``SHARED_INPUT_GROUPS`` found among target ``names`` (one prefix each, every member a target
    of one input width); a name is in at most one group."""
    present, grouped, groups = set(names), set(), []
    for pattern in SHARED_INPUT_GROUPS:
        for name in names:
            if not (name == pattern[0] or name.endswith("." + pattern[0])):
                continue
            prefix = name[: len(name) - len(pattern[0])]
            members = [prefix + member for member in pattern]
            if all(m in present and m not in grouped for m in members) and (
                len({in_features[m] for m in members}) == 1
            ):
                groups.append(members)
                grouped.update(members)
    return groups


def lora_targets(module: nn.Module) -> dict[str, nn.Module]:
    """Every linear of ``module`` an adapter may target: ``nn.Linear`` and ``fp8_cache.FP8Linear``, by name."""
    from fp8_cache import FP8Linear

    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, FP8Linear))}


ALL_LINEAR = "all-linear"


def select_targets(names: Iterable[str], target_modules: Sequence[str]) -> list[str]:
    """The ``names`` (module names) that ``target_modules`` selects as PEFT's ``target_modules`` list does: a name
    equal to an entry or ending in ``"." + entry``; ``["all-linear"]`` selects them all. ``ValueError`` for an entry
    that selects nothing."""
    names = list(names)
    if not target_modules:
        raise ValueError("no target modules given")
    unmatched = [t for t in target_modules if not any(is_target(n, [t]) for n in names)]
    if unmatched:
        raise ValueError(f"target module {unmatched[0]!r} names no linear of the transformer")
    return [n for n in names if is_target(n, target_modules)]


def is_target(name: str, target_modules: Sequence[str]) -> bool:
    """Whether ``select_targets`` would select module ``name``."""
    return any(t == ALL_LINEAR or name == t or name.endswith("." + t) for t in target_modules)


@functools.cache
def _configure_dynamo_for_lora() -> None:
    """Once per process (the settings are dynamo's, global): see ``LoRARuntime.compiled``."""
    import torch._dynamo.config

    torch._dynamo.config.force_nn_module_property_static_shapes = False
    torch._dynamo.config.recompile_limit *= 2


AdapterReader = Callable[[Path], LoRAWeights]


@dataclass
class _Slot:
    adapter: LoRAAdapter | None = None
    last_used: int = 0


@dataclass
class LoRAStats:
    """Counters since the pipeline loaded (for logs and benchmarks)."""

    slot_loads: int = 0
    file_reads: int = 0
    forwards_split: int = 0
    slot_load_s: float = 0.0
    file_read_s: float = 0.0


class LoRARuntime:
    """The adapters of one transformer: registry, host LRU, device slots, and the hooks that apply them.

    ``read(path)`` turns an adapter file into ``LoRAWeights`` checked against this transformer (raising
    ``LoRAError``); it is ``omni_models.lora_files``' reader for the family. Not thread-safe: the pipeline's caller
    drives it.
    """

    def __init__(
        self,
        transformer: nn.Module,
        read: AdapterReader,
        options: LoRAOptions,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: Backend = "auto",
        compiled_path: CompiledPath = "torch",
    ) -> None:
        self.options = options
        self.compiled_path = compiled_path
        self.rank = padded_rank(options.max_rank)
        self._read = read
        self._device = device
        self.backend = backend
        self._registry: dict[str, LoRAAdapter] = {}
        self._host: OrderedDict[int, tuple[LoRAAdapter, LoRAWeights]] = OrderedDict()  # id(adapter) -> weights
        self._slots = [_Slot() for _ in range(options.max_loras)]
        self._clock = 0
        self._rows: LoRARows | None = None
        self._copied = False  # inside ``rows()``, when it made the row path's copy
        self._apply = False  # inside ``rows()`` with a row on an adapter (or ``warming()``): the hooks add
        self.stats = LoRAStats()
        self._compiled = False
        self._warming = False
        self._dtype = dtype
        self._linears = lora_targets(transformer)
        self._hooks = []
        self._install(self._linears)

    def _install(self, linears: Mapping[str, nn.Module]) -> None:
        """Slot buffers, row views and a hook for each of ``linears`` (every group's members side by side)."""
        options, device, dtype = self.options, self._device, self._dtype
        groups = shared_input_groups(list(linears), {name: m.in_features for name, m in linears.items()})
        group_of = {name: group for group in groups for name in group}
        order: list[str] = []  # the buffers' layout: each group's members side by side, the first where it was
        for name in linears:
            if name not in order:
                order.extend(group_of.get(name, [name]))
        linears = {name: linears[name] for name in order}
        down_sizes = [self.rank * m.in_features for m in linears.values()]
        up_sizes = [self.rank * m.out_features for m in linears.values()]
        slots = options.max_loras + 1  # the last one stays zero: what a row without an adapter copies
        self._down_flat = torch.zeros(slots, sum(down_sizes), device=device, dtype=dtype)
        self._up_flat = torch.zeros(slots, sum(up_sizes), device=device, dtype=dtype)
        self.groups: list[SharedShrink] = []
        self._unit_scaling = torch.ones(options.max_loras, device=device, dtype=torch.float32)
        self._row_copy: tuple[Tensor, Tensor] | None = None  # [rows, ...] of both buffers, grown to the most rows
        self._row_views = 0  # the row count the targets' row views are for
        self.targets: dict[str, TargetSlots] = {}
        down_offset = up_offset = 0
        for (name, linear), down_size, up_size in zip(linears.items(), down_sizes, up_sizes, strict=True):
            target = TargetSlots(
                self._down_flat,
                self._up_flat,
                (down_offset, up_offset),
                linear.in_features,
                linear.out_features,
                num_slots=options.max_loras,
                rank=self.rank,
            )
            down_offset += down_size
            up_offset += up_size
            self.targets[name] = target
            self._hooks.append(linear.register_forward_hook(self._hook(target)))
        for members in groups:
            group = SharedShrink(members, self.rank, [linears[name].out_features for name in members])
            for index, name in enumerate(members):
                self.targets[name].group, self.targets[name].member = group, index
            self.groups.append(group)
        logger.info(
            "LoRA: %d target linears (%d groups sharing an input), %d slots of rank %d (%.1f MB on %s)",
            len(self.targets),
            len(self.groups),
            options.max_loras,
            self.rank,
            sum(s.nbytes for s in self.targets.values()) / 2**20,
            device,
        )

    def restrict(self, names: Collection[str]) -> None:
        """Apply LoRA to the linears ``names`` only (``select_targets``), before the first forward that could
        apply one: the others lose their hook and slots, so a forward launches nothing for them, and ``register``
        refuses an adapter with layers there. An adapter registered already must lie within ``names``; the slots
        are emptied (they refill when used). For a fixed set of adapters, the linears they hold (vLLM's
        ``--lora-target-modules``, which omni-server derives from ``--lora-modules`` when adapters cannot be added
        at run time)."""
        if self._rows is not None:
            raise RuntimeError("LoRARuntime.restrict() inside rows()")
        keep = set(names)
        unknown = sorted(keep - set(self._linears))
        if unknown:
            raise ValueError(f"not linears of this transformer: {', '.join(unknown[:3])}")
        if not keep:
            raise ValueError("restrict() needs at least one target linear")
        for adapter in self._registry.values():
            outside = sorted(adapter.layers - keep)
            if outside:
                raise ValueError(f"adapter {adapter.name!r} has layers outside the targets (e.g. {outside[0]})")
        self.close()
        self._slots = [_Slot() for _ in range(self.options.max_loras)]
        self._install({name: m for name, m in self._linears.items() if name in keep})

    @property
    def linears(self) -> list[str]:
        """Every linear an adapter could target (``lora_targets``), whatever ``restrict`` kept."""
        return list(self._linears)

    def registered_layers(self) -> set[str]:
        """The linears that the registered adapters hold layers for."""
        return {name for adapter in self._registry.values() for name in adapter.layers}

    @property
    def backend(self) -> Backend:
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        """``"auto"`` (Triton on CUDA, the torch reference elsewhere), ``"torch"`` or ``"triton"``."""
        self._triton = use_triton(backend, self._device)
        self._backend = backend

    @property
    def compiled(self) -> bool:
        return self._compiled

    @compiled.setter
    def compiled(self, compiled: bool) -> None:
        """The pipeline compiles its blocks (set before their first forward): the row path's copy is made for
        them, and dynamo traces the tensors the hooks read (the row views and the table, reached through each
        linear's hook) with symbolic shapes. By default it gives every tensor it reaches through a built-in
        ``nn.Module`` static shapes, which would specialize the LoRA graphs on the row count (one graph per count);
        parameters and buffers keep their static shapes (``force_parameter_static_shapes``). A block needs twice the
        graphs it needs without LoRA (each with the LoRA ops and without), so dynamo's per-function limit doubles
        too (past it, dynamo runs the function eagerly from then on)."""
        if compiled:
            _configure_dynamo_for_lora()
        self._compiled = compiled

    @property
    def compiled_path(self) -> CompiledPath:
        return self._compiled_path

    @compiled_path.setter
    def compiled_path(self, path: CompiledPath) -> None:
        """What a compiled graph runs: ``"torch"`` (the row path, traced), ``"kernels"`` (the Triton pair as one
        opaque op, where ``backend`` runs them; the reference otherwise) or ``"reference"`` (the per-linear gather of
        ``lora_delta_reference``, traced). Set it before the first compiled forward: dynamo reads it once, while
        tracing."""
        if path not in COMPILED_PATHS:
            raise ValueError(f"compiled_path must be one of {list(COMPILED_PATHS)}, got {path!r}")
        self._compiled_path = path

    def _hook(self, slots: TargetSlots) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
        def add_lora(_module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            # Outside ``rows()``, or no row on an adapter: the base model alone, no launch. A compiled graph
            # guards on this one bool: a graph with the LoRA ops, and one without.
            if not self._apply:
                return output
            rows, x = self._rows, args[0]
            _check_rows(x, rows)
            if torch.compiler.is_compiling():
                path = self._compiled_path
                triton = self._triton and path == "kernels"
            else:  # eager: the row path where ``rows()`` made the row copy (a compiled model's linears outside its
                # blocks: two small matmuls cost less host time than the kernels' opaque op), else the kernels
                triton = self._triton and not self._copied
                path = "kernels" if triton else "torch"
            if path == "torch":  # ``rows()`` made the row copy (eager without Triton, or ``compiled``)
                if slots.group is None:
                    return lora_add_rows(output, x, slots.row_down, slots.row_up)
                return output + slots.group.delta(x, slots.member).reshape(output.shape)
            return lora_add(output, x, slots.down, slots.up, self._unit_scaling, rows, triton=triton)

        return add_lora

    # --- the registry ------------------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read ``path`` (checked against the transformer) and make it servable as ``name``. Raises ``LoRAError``
        for a bad file and ``ValueError`` for a name already registered; nothing changes then."""
        if name in self._registry:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        start = time.perf_counter()
        weights = self._read(Path(path))
        outside = sorted(set(weights.layers) - set(self.targets))
        if outside:
            raise LoRAError(
                Path(path),
                f"holds layers for {len(outside)} linears this server does not apply LoRA to (e.g. "
                f"{', '.join(outside[:3])}); its target modules are restricted (--lora-target-modules, or the "
                "linears of --lora-modules when adapters cannot be loaded at run time)",
            )
        adapter = LoRAAdapter(
            name=name,
            path=Path(path),
            rank=weights.rank,
            num_layers=len(weights.layers),
            nbytes=weights.nbytes,
            load_s=time.perf_counter() - start,
            layers=frozenset(weights.layers),
        )
        self._registry[name] = adapter
        self._keep_on_host(adapter, weights)
        logger.info(
            "LoRA adapter %s: rank %d, %d layers, %.2f MB, read in %.3f s",
            name,
            adapter.rank,
            adapter.num_layers,
            adapter.nbytes / 2**20,
            adapter.load_s,
        )
        return adapter

    def unregister(self, name: str) -> LoRAAdapter:
        """Stop serving ``name`` to new requests (jobs holding it finish with it); ``KeyError`` if unknown."""
        adapter = self._registry.pop(name)
        self._host.pop(id(adapter), None)
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        return self._registry.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        return list(self._registry.values())

    # --- host LRU ----------------------------------------------------------------------------------------------

    def _keep_on_host(self, adapter: LoRAAdapter, weights: LoRAWeights) -> None:
        if self._device.type == "cuda":
            weights = LoRAWeights(
                {
                    name: LoRALayer(layer.down.pin_memory(), layer.up.pin_memory(), layer.scaling)
                    for name, layer in weights.layers.items()
                }
            )
        self._host[id(adapter)] = (adapter, weights)
        self._host.move_to_end(id(adapter))
        while len(self._host) > self.options.host_capacity:
            self._host.popitem(last=False)

    def _host_weights(self, adapter: LoRAAdapter) -> LoRAWeights:
        entry = self._host.get(id(adapter))
        if entry is not None:
            self._host.move_to_end(id(adapter))
            return entry[1]
        start = time.perf_counter()
        weights = self._read(adapter.path)  # evicted: read again
        self.stats.file_reads += 1
        self.stats.file_read_s += time.perf_counter() - start
        self._keep_on_host(adapter, weights)
        return weights

    # --- device slots --------------------------------------------------------------------------------------------

    def partition(self, adapters: Sequence[LoRAAdapter | None]) -> list[list[int]]:
        """Indices of ``adapters`` (one per job, in order) grouped into forwards of at most ``max_loras`` distinct
        adapters each (jobs without one join any group); one group when they fit."""
        groups: list[list[int]] = []
        distinct: list[set[int]] = []
        for index, adapter in enumerate(adapters):
            key = None if adapter is None else id(adapter)
            for group, seen in zip(groups, distinct, strict=True):
                if key is None or key in seen or len(seen) < self.options.max_loras:
                    group.append(index)
                    if key is not None:
                        seen.add(key)
                    break
            else:
                groups.append([index])
                distinct.append(set() if key is None else {key})
        if len(groups) > 1:
            self.stats.forwards_split += len(groups) - 1
        return groups

    def _slot_of(self, adapter: LoRAAdapter, pinned: set[int]) -> int:
        """The slot holding ``adapter``, loading it into the least recently used slot not in ``pinned``."""
        self._clock += 1
        for index, slot in enumerate(self._slots):
            if slot.adapter is adapter:
                slot.last_used = self._clock
                return index
        free = [i for i in range(len(self._slots)) if i not in pinned]
        index = min(free, key=lambda i: (self._slots[i].adapter is not None, self._slots[i].last_used))
        weights = self._host_weights(adapter)
        start = time.perf_counter()
        for name, target in self.targets.items():
            target.write(index, weights.layers.get(name))
        self.stats.slot_loads += 1
        self.stats.slot_load_s += time.perf_counter() - start
        self._slots[index] = _Slot(adapter, self._clock)
        return index

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[LoRAAdapter | None], scales: Sequence[float]) -> Iterator[LoRARows]:
        """Within this block, forwards apply ``adapters[b]`` at ``scales[b]`` to row ``b`` (``None``: base only).
        At most ``max_loras`` distinct adapters (``partition``); one row table at a time (no nesting)."""
        if self._rows is not None:
            raise RuntimeError("LoRARuntime.rows() does not nest: one row table per forward")
        pinned: set[int] = set()
        indices = []
        for adapter in adapters:
            if adapter is None:
                indices.append(-1)
                continue
            index = self._slot_of(adapter, pinned)
            pinned.add(index)
            indices.append(index)
        if len(pinned) > self.options.max_loras:  # pragma: no cover - _slot_of never evicts a pinned slot
            raise AssertionError("more adapters than slots in one forward")
        any_adapter = bool(pinned) or self._warming
        device_slots = self._on_device(torch.tensor(indices, dtype=torch.int32))
        device_scales = self._on_device(torch.tensor([float(s) for s in scales], dtype=torch.float32))
        self._copied = any_adapter and (not self._triton or (self.compiled and self._compiled_path == "torch"))
        if self._copied:
            self._copy_rows(indices, scales, device_scales)
        self._rows = LoRARows(device_slots, device_scales, any_adapter=any_adapter)
        self._apply = any_adapter
        try:
            yield self._rows
        finally:
            self._rows, self._apply, self._copied = None, False, False
            for group in self.groups:  # a forward that raised between a group's members
                group.clear()

    def _copy_rows(self, indices: list[int], scales: Sequence[float], device_scales: Tensor) -> None:
        """The row path's copy: every row's slot (the zero slot for -1), all targets in one copy per row and
        buffer, into a buffer kept for the most rows seen (``rows x`` one slot's bytes); each row's scale folded into
        its ``up``; the targets' row views re-pointed only when the row count changes."""
        num_rows = len(indices)
        if self._row_copy is None or self._row_copy[0].shape[0] < num_rows:
            self._row_copy = tuple(flat.new_empty(num_rows, flat.shape[1]) for flat in (self._down_flat, self._up_flat))
            self._row_views = 0
        down_rows, up_rows = (buffer[:num_rows] for buffer in self._row_copy)
        for row, index in enumerate(indices):  # a copy per row: index_select took 0.6 ms a buffer on the H200
            slot = len(self._slots) if index < 0 else index
            down_rows[row].copy_(self._down_flat[slot])
            up_rows[row].copy_(self._up_flat[slot])
        if any(float(s) != 1.0 for s in scales):
            up_rows.mul_(device_scales[:, None])
        if self._row_views != num_rows:
            for target in self.targets.values():
                target.view_rows(down_rows, up_rows)
            for group in self.groups:
                first = self.targets[group.names[0]]
                group.view_rows(down_rows, up_rows, (first.down_offset, first.up_offset), first.in_features)
            self._row_views = num_rows

    def _on_device(self, host: Tensor) -> Tensor:
        return host.to(self._device, non_blocking=True)

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Within this block, forwards take the LoRA path even when no row has an adapter (a zero delta: the base
        output exactly), so that an engine's warm-up compiles the graphs with the LoRA ops as well as those
        without, before any adapter is used."""
        previous, self._warming = self._warming, True
        try:
            yield
        finally:
            self._warming = previous

    def resident(self) -> list[str | None]:
        """Which adapter each device slot holds (by name), for tests and logs."""
        return [None if s.adapter is None else s.adapter.name for s in self._slots]

    def host_resident(self) -> list[str]:
        return [adapter.name for adapter, _ in self._host.values()]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


__all__ = [
    "ALL_LINEAR",
    "CompiledPath",
    "LoRAAdapter",
    "LoRAError",
    "LoRALayer",
    "LoRAOptions",
    "LoRARows",
    "LoRARuntime",
    "LoRAStats",
    "LoRAWeights",
    "SHARED_INPUT_GROUPS",
    "SharedShrink",
    "TargetSlots",
    "is_target",
    "lora_add",
    "lora_add_rows",
    "lora_delta_reference",
    "lora_targets",
    "padded_rank",
    "select_targets",
    "shared_input_groups",
    "use_triton",
]
