"""`OffloadPlan`: which modules stream from the host and which stay on the device.

A model declares its plan; `resolve_plan` checks it against the live module tree
and returns the concrete modules. Resolution never mutates the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadPlan:
    """A model's offload declaration.

    Attributes:
        blocks: dotted attribute path of the `nn.ModuleList` (or `nn.Sequential`) of
            repeated blocks, e.g. ``"blocks"`` or ``"transformer.layers"``.
        resident_blocks: how many leading blocks stay on the device for the whole
            lifetime of the offload; the rest stream from the host. A count larger
            than the list keeps every block resident.
        resident_modules: dotted paths of non-block modules that are moved to the
            device (embeddings, final norm, projection heads). Modules named nowhere
            in the plan are left where they are.
    """

    blocks: str
    resident_blocks: int = 0
    resident_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, str) or not self.blocks.strip():
            raise ValueError(
                f"OffloadPlan.blocks must be the dotted path of the model's block list "
                f"(e.g. 'blocks'), got {self.blocks!r}"
            )
        if isinstance(self.resident_blocks, bool) or not isinstance(self.resident_blocks, int):
            raise TypeError(f"OffloadPlan.resident_blocks must be an int, got {self.resident_blocks!r}")
        if self.resident_blocks < 0:
            raise ValueError(f"OffloadPlan.resident_blocks must be >= 0, got {self.resident_blocks}")
        if isinstance(self.resident_modules, str) or not all(
            isinstance(p, str) and p for p in self.resident_modules
        ):
            raise TypeError(
                "OffloadPlan.resident_modules must be a tuple of non-empty dotted paths, "
                f"got {self.resident_modules!r}"
            )
        object.__setattr__(self, "resident_modules", tuple(self.resident_modules))
        if len(set(self.resident_modules)) != len(self.resident_modules):
            raise ValueError(f"OffloadPlan.resident_modules lists a path twice: {self.resident_modules!r}")


@dataclass(frozen=True)
class ResolvedPlan:
    """An `OffloadPlan` bound to one model's live modules.

    Invariants: ``block_names[i]`` is the fully qualified name of ``blocks[i]``;
    blocks ``[0, resident_count)`` are resident and ``[resident_count, len)`` stream;
    no tensor is shared between two blocks or between a block and a resident module.
    """

    blocks: tuple[nn.Module, ...]
    block_names: tuple[str, ...]
    resident_count: int
    resident_modules: tuple[tuple[str, nn.Module], ...]

    @property
    def streamed(self) -> tuple[tuple[str, nn.Module], ...]:
        return tuple(zip(self.block_names, self.blocks))[self.resident_count :]

    @property
    def resident(self) -> tuple[tuple[str, nn.Module], ...]:
        return tuple(zip(self.block_names, self.blocks))[: self.resident_count]


def _lookup(model: nn.Module, path: str, field: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        children = [name for name, _ in model.named_children()]
        raise ValueError(
            f"OffloadPlan.{field} path {path!r} does not name a submodule of "
            f"{type(model).__name__}; its top-level children are {children}"
        ) from None


def _tensor_ids(module: nn.Module) -> set[int]:
    return {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}


def resolve_plan(model: nn.Module, plan: OffloadPlan) -> ResolvedPlan:
    """Bind `plan` to `model`, raising a ValueError that names the bad field."""
    block_list = _lookup(model, plan.blocks, "blocks")
    if not isinstance(block_list, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"OffloadPlan.blocks path {plan.blocks!r} is a {type(block_list).__name__}; "
            "it must be the nn.ModuleList (or nn.Sequential) holding the repeated blocks"
        )
    blocks = tuple(block_list)
    if not blocks:
        raise ValueError(f"OffloadPlan.blocks path {plan.blocks!r} is empty: there is nothing to offload")
    names = tuple(f"{plan.blocks}.{i}" for i in range(len(blocks)))

    seen: dict[int, str] = {}
    for name, block in zip(names, blocks):
        for tid in _tensor_ids(block):
            if tid in seen and seen[tid] != name:
                raise ValueError(
                    f"blocks {seen[tid]!r} and {name!r} share a parameter or buffer; streamed blocks "
                    "must own their tensors (untie the weights or keep the sharing module resident)"
                )
            seen[tid] = name

    resident_modules = []
    for path in plan.resident_modules:
        module = _lookup(model, path, "resident_modules")
        if path == plan.blocks or path.startswith(plan.blocks + ".") or plan.blocks.startswith(path + "."):
            raise ValueError(
                f"OffloadPlan.resident_modules entry {path!r} overlaps the block list {plan.blocks!r}; "
                "keep leading blocks on the device with resident_blocks instead"
            )
        shared = _tensor_ids(module) & set(seen)
        if shared:
            raise ValueError(
                f"resident module {path!r} shares a tensor with block {seen[next(iter(shared))]!r}; "
                "a tensor cannot both stream and stay resident"
            )
        resident_modules.append((path, module))

    resident_count = min(plan.resident_blocks, len(blocks))
    if plan.resident_blocks > len(blocks):
        logger.warning(
            "resident_blocks=%d exceeds the %d blocks of %r; every block stays resident",
            plan.resident_blocks, len(blocks), plan.blocks,
        )
    return ResolvedPlan(blocks, names, resident_count, tuple(resident_modules))
