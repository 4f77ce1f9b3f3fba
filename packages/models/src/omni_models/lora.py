"""Unmerged LoRA served per request: rows of one batched forward each use their own adapter (or none).

The base weights are never touched (bf16, FP8 linears from ``fp8_cache``, or blocks streamed by ``dlo_offload``):
each target linear gets a forward hook that adds ``scale[row] * scaling[slot, module] * (x @ A[slot]^T) @
B[slot]^T`` to its output, row by row (Punica's SGMV applied to the rows of a DiT batch: a row is one image's
cond or uncond pass, so a segment is a whole row). ``lora_add`` is the one op: eager, a Triton shrink + expand
kernel pair on CUDA and the torch reference elsewhere; inside a compiled graph, ``LoRARuntime.compiled_path``
says which (``"torch"``, the default: the reference's gather and two batched matmuls, traced into the block's
graph so that inductor fuses the scale and the add into the ops around them; ``"kernels"``: the Triton pair as
one opaque op).

Invariants:
- Fixed shapes. Every target linear owns ``max_loras`` device slots (``A: [max_loras, R, in]``, ``B:
  [max_loras, out, R]``) allocated once, rank zero-padded to ``R`` (``padded_rank(max_rank)``); loading an adapter
  copies into a slot in place, so switching or mixing adapters never changes a shape the compiled graph sees.
  The per-forward row table (``LoRARows``: slot index, -1 for none, and scale per row) is a tensor input.
- Exactness of "none": a row without an adapter gets exactly the base output (the kernel skips it; the reference
  adds ``0 *`` a finite delta).
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
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from omni_models.errors import CheckpointError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
CompiledPath = Literal["torch", "kernels"]
MIN_PADDED_RANK = 16  # tl.dot needs at least 16 along every dimension


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


@dataclass(frozen=True)
class LoRARows:
    """The row table of one forward: ``slots`` int32 ``[rows]`` (-1: no adapter) and ``scales`` float32 ``[rows]``
    on the device; ``any_adapter``: some row has one (host-side, so the reference path can skip a forward without)."""

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
    batch = x.shape[0]
    if batch != rows.num_rows:
        raise ValueError(
            f"a LoRA target got {batch} rows but the forward's row table has {rows.num_rows}: the module's leading "
            "dimension is not the batch of rows"
        )
    x3 = x.reshape(batch, -1, x.shape[-1])
    if triton:
        _lora_shrink_expand(y, x3.contiguous(), down, up, scaling, rows.slots, rows.scales)
        return y
    delta = lora_delta_reference(x3, down, up, scaling, rows.slots, rows.scales)
    return y + delta.view(y.shape).to(y.dtype)


# --- slots and hooks -------------------------------------------------------------------------------------------


class TargetSlots:
    """The device slots of one target linear: ``down [L, R, in]``, ``up [L, out, R]``, ``scaling`` float32 [L]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        num_slots: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.down = torch.zeros(num_slots, rank, in_features, device=device, dtype=dtype)
        self.up = torch.zeros(num_slots, out_features, rank, device=device, dtype=dtype)
        self.scaling = torch.zeros(num_slots, device=device, dtype=torch.float32)

    def write(self, slot: int, layer: LoRALayer | None) -> None:
        """Slot ``slot`` holds ``layer`` (zero-padded to the slot rank), or nothing (``None``: a zero delta)."""
        if layer is None:
            self.down[slot].zero_()
            self.up[slot].zero_()
            self.scaling[slot] = 0.0
            return
        r = layer.rank
        self.down[slot, :r].copy_(layer.down, non_blocking=True)
        self.down[slot, r:].zero_()
        self.up[slot, :, :r].copy_(layer.up, non_blocking=True)
        self.up[slot, :, r:].zero_()
        self.scaling[slot] = layer.scaling

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.down, self.up, self.scaling))


def lora_targets(module: nn.Module) -> dict[str, nn.Module]:
    """Every linear of ``module`` an adapter may target: ``nn.Linear`` and ``fp8_cache.FP8Linear``, by name."""
    from fp8_cache import FP8Linear

    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, FP8Linear))}


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
        self.stats = LoRAStats()
        self.targets: dict[str, TargetSlots] = {}
        self._hooks = []
        for name, linear in lora_targets(transformer).items():
            slots = TargetSlots(
                linear.in_features,
                linear.out_features,
                num_slots=options.max_loras,
                rank=self.rank,
                device=device,
                dtype=dtype,
            )
            self.targets[name] = slots
            self._hooks.append(linear.register_forward_hook(self._hook(slots)))
        logger.info(
            "LoRA: %d target linears, %d slots of rank %d (%.1f MB on %s)",
            len(self.targets),
            options.max_loras,
            self.rank,
            sum(s.nbytes for s in self.targets.values()) / 2**20,
            device,
        )

    @property
    def backend(self) -> Backend:
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        """``"auto"`` (Triton on CUDA, the torch reference elsewhere), ``"torch"`` or ``"triton"``."""
        self._triton = use_triton(backend, self._device)
        self._backend = backend

    @property
    def compiled_path(self) -> CompiledPath:
        return self._compiled_path

    @compiled_path.setter
    def compiled_path(self, path: CompiledPath) -> None:
        """What a compiled graph runs: ``"torch"`` (the reference's ops, traced) or ``"kernels"`` (the Triton pair
        as one opaque op, where ``backend`` runs them; the reference otherwise). Set it before the first compiled
        forward: dynamo reads it once, while tracing."""
        if path not in ("torch", "kernels"):
            raise ValueError(f"compiled_path must be 'torch' or 'kernels', got {path!r}")
        self._compiled_path = path

    def _hook(self, slots: TargetSlots) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
        def add_lora(_module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            rows = self._rows
            if rows is None:  # a forward outside ``rows()``: the base model alone
                return output
            # A compiled graph always adds the delta (zero for a row without an adapter), so one graph serves
            # batches with adapters and without them: the test on ``is_compiling`` comes first, so that dynamo
            # never reads (and guards on) ``any_adapter``.
            if torch.compiler.is_compiling():
                triton = self._triton and self._compiled_path == "kernels"
                return lora_add(output, args[0], slots.down, slots.up, slots.scaling, rows, triton=triton)
            if not rows.any_adapter:  # eager, no row has an adapter: nothing to add, no launch
                return output
            return lora_add(output, args[0], slots.down, slots.up, slots.scaling, rows, triton=self._triton)

        return add_lora

    # --- the registry ------------------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read ``path`` (checked against the transformer) and make it servable as ``name``. Raises ``LoRAError``
        for a bad file and ``ValueError`` for a name already registered; nothing changes then."""
        if name in self._registry:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        start = time.perf_counter()
        weights = self._read(Path(path))
        adapter = LoRAAdapter(
            name=name,
            path=Path(path),
            rank=weights.rank,
            num_layers=len(weights.layers),
            nbytes=weights.nbytes,
            load_s=time.perf_counter() - start,
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
        At most ``max_loras`` distinct adapters (``partition``)."""
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
        table = LoRARows(
            torch.tensor(indices, dtype=torch.int32).to(self._device, non_blocking=True),
            torch.tensor([float(s) for s in scales], dtype=torch.float32).to(self._device, non_blocking=True),
            any_adapter=bool(pinned),
        )
        previous, self._rows = self._rows, table
        try:
            yield table
        finally:
            self._rows = previous

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
    "CompiledPath",
    "LoRAAdapter",
    "LoRAError",
    "LoRALayer",
    "LoRAOptions",
    "LoRARows",
    "LoRARuntime",
    "LoRAStats",
    "LoRAWeights",
    "TargetSlots",
    "lora_add",
    "lora_delta_reference",
    "lora_targets",
    "padded_rank",
    "use_triton",
]
