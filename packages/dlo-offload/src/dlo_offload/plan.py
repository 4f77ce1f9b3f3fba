"""`OffloadPlan`: which modules stream from the host and which stay on the device.

A model declares its plan; `resolve_plan` checks it against the live module tree
and returns the concrete modules. Resolution never mutates the model.

A plan may name several block lists (FLUX runs ``transformer_blocks`` and then
``single_transformer_blocks``): they are streamed as one sequence, in the order the
plan lists them, which must be the order the model's forward runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadPlan:
    """A model's offload declaration.

    Attributes:
        blocks: dotted attribute path of the `nn.ModuleList` (or `nn.Sequential`) of
            repeated blocks, e.g. ``"blocks"`` or ``"transformer.layers"``; or a tuple
            of such paths, in the order the forward runs them (e.g.
            ``("transformer_blocks", "single_transformer_blocks")``). A sequence is
            stored as a tuple; a single path stays a string (see ``block_lists``).
        resident_blocks: how many leading blocks, counted across the lists in order,
            stay on the device for the whole lifetime of the offload; the rest stream
            from the host. A count larger than all lists together keeps every block
            resident.
        resident_modules: dotted paths of non-block modules that are moved to the
            device (embeddings, final norm, projection heads). Modules named nowhere
            in the plan are left where they are.
    """

    blocks: str | tuple[str, ...]
    resident_blocks: int = 0
    resident_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        paths = [self.blocks] if isinstance(self.blocks, str) else self.blocks
        if not isinstance(paths, Sequence) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            raise ValueError(
                f"OffloadPlan.blocks must be the dotted path of the model's block list "
                f"(e.g. 'blocks') or a non-empty tuple of such paths, got {self.blocks!r}"
            )
        if not isinstance(self.blocks, str):
            object.__setattr__(self, "blocks", tuple(self.blocks))
            if len(set(self.blocks)) != len(self.blocks):
                raise ValueError(f"OffloadPlan.blocks lists a path twice: {self.blocks!r}")
        if isinstance(self.resident_blocks, bool) or not isinstance(self.resident_blocks, int):
            raise TypeError(f"OffloadPlan.resident_blocks must be an int, got {self.resident_blocks!r}")
        if self.resident_blocks < 0:
            raise ValueError(f"OffloadPlan.resident_blocks must be >= 0, got {self.resident_blocks}")
        if isinstance(self.resident_modules, str) or not all(isinstance(p, str) and p for p in self.resident_modules):
            raise TypeError(
                f"OffloadPlan.resident_modules must be a tuple of non-empty dotted paths, got {self.resident_modules!r}"
            )
        object.__setattr__(self, "resident_modules", tuple(self.resident_modules))
        if len(set(self.resident_modules)) != len(self.resident_modules):
            raise ValueError(f"OffloadPlan.resident_modules lists a path twice: {self.resident_modules!r}")

    @property
    def block_lists(self) -> tuple[str, ...]:
        """The block-list paths in execution order (one entry for a single-list plan)."""
        return (self.blocks,) if isinstance(self.blocks, str) else self.blocks


@dataclass(frozen=True)
class ResolvedPlan:
    """An `OffloadPlan` bound to one model's live modules.

    Invariants: ``blocks`` concatenates the plan's block lists in execution order;
    ``block_names[i]`` is the fully qualified name of ``blocks[i]``;
    blocks ``[0, resident_count)`` are resident and ``[resident_count, len)`` stream;
    no tensor is shared between two blocks or between a block and a resident module.
    """

    blocks: tuple[nn.Module, ...]
    block_names: tuple[str, ...]
    resident_count: int
    resident_modules: tuple[tuple[str, nn.Module], ...]

    @property
    def streamed(self) -> tuple[tuple[str, nn.Module], ...]:
        return tuple(zip(self.block_names, self.blocks, strict=True))[self.resident_count :]

    @property
    def resident(self) -> tuple[tuple[str, nn.Module], ...]:
        return tuple(zip(self.block_names, self.blocks, strict=True))[: self.resident_count]


def _lookup(model: nn.Module, path: str, field: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        children = [name for name, _ in model.named_children()]
        raise ValueError(
            f"OffloadPlan.{field} path {path!r} does not name a submodule of "
            f"{type(model).__name__}; its top-level children are {children}"
        ) from None


def _overlaps(a: str, b: str) -> bool:
    """Whether one dotted path is the other or lies inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _tensor_ids(module: nn.Module) -> set[int]:
    return {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}


def _resolve_block_list(model: nn.Module, path: str) -> tuple[nn.Module, ...]:
    block_list = _lookup(model, path, "blocks")
    if not isinstance(block_list, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"OffloadPlan.blocks path {path!r} is a {type(block_list).__name__}; "
            "it must be the nn.ModuleList (or nn.Sequential) holding the repeated blocks"
        )
    blocks = tuple(block_list)
    if not blocks:
        raise ValueError(f"OffloadPlan.blocks path {path!r} is empty: there is nothing to offload")
    return blocks


def resolve_plan(model: nn.Module, plan: OffloadPlan) -> ResolvedPlan:
    """Bind `plan` to `model`, raising a ValueError that names the bad field."""
    lists = plan.block_lists
    for i, path in enumerate(lists):
        for other in lists[:i]:
            if _overlaps(path, other):
                raise ValueError(f"OffloadPlan.blocks paths {other!r} and {path!r} overlap; list each block once")
    blocks: tuple[nn.Module, ...] = ()
    names: tuple[str, ...] = ()
    for path in lists:
        listed = _resolve_block_list(model, path)
        blocks += listed
        names += tuple(f"{path}.{i}" for i in range(len(listed)))

    seen: dict[int, str] = {}
    for name, block in zip(names, blocks, strict=True):
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
        overlapping = next((blocks_path for blocks_path in lists if _overlaps(path, blocks_path)), None)
        if overlapping is not None:
            raise ValueError(
                f"OffloadPlan.resident_modules entry {path!r} overlaps the block list {overlapping!r}; "
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
            plan.resident_blocks,
            len(blocks),
            plan.blocks,
        )
    return ResolvedPlan(blocks, names, resident_count, tuple(resident_modules))
