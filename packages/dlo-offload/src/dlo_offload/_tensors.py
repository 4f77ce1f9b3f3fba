"""Re-pointing a module's parameters and buffers without changing the module."""

from __future__ import annotations

import torch
from torch import nn

from .layout import TensorKind


def owner_of(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that owns the tensor `name` (local to `block`) and its attribute name."""
    path, _, attr = name.rpartition(".")
    return (block.get_submodule(path) if path else block), attr


def get_tensor(owner: nn.Module, attr: str, kind: TensorKind) -> torch.Tensor:
    return owner._parameters[attr] if kind == "parameter" else owner._buffers[attr]  # type: ignore[return-value]


def set_tensor(owner: nn.Module, attr: str, kind: TensorKind, value: torch.Tensor) -> None:
    """Make ``owner.<attr>`` read `value`, keeping the Parameter object when possible.

    Swapping ``.data`` keeps identity (optimisers, tied references and hooks held
    elsewhere keep working); a meta tensor cannot take real data that way, so it is
    replaced by a new Parameter (or buffer) with the same ``requires_grad``.
    """
    current = get_tensor(owner, attr, kind)
    if current is not None and not current.is_meta:
        current.data = value
    elif kind == "parameter":
        requires_grad = bool(current is not None and current.requires_grad)
        owner._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        # A fresh tensor object: modules dedupe buffers by identity, and placeholders are shared.
        owner._buffers[attr] = value.detach()


class SavedTensor:
    """A tensor slot's original object and data, so it can be put back exactly."""

    __slots__ = ("owner", "attr", "kind", "obj", "data", "from_checkpoint")

    def __init__(self, owner: nn.Module, attr: str, kind: TensorKind, *, from_checkpoint: bool = False) -> None:
        self.owner, self.attr, self.kind = owner, attr, kind
        self.from_checkpoint = from_checkpoint
        self.obj = get_tensor(owner, attr, kind)
        self.data = self.obj.data if self.obj is not None else None

    def restore(self) -> None:
        table = self.owner._parameters if self.kind == "parameter" else self.owner._buffers
        table[self.attr] = self.obj  # type: ignore[assignment]
        if self.obj is not None and self.data is not None and self.obj.data is not self.data:
            self.obj.data = self.data

    def to_host(self) -> None:
        """Replace the live tensor by a CPU copy with the same layout (for checkpoint-realized tensors)."""
        live = get_tensor(self.owner, self.attr, self.kind)
        host = torch.empty_strided(live.shape, live.stride(), dtype=live.dtype, device="cpu")
        set_tensor(self.owner, self.attr, self.kind, host.copy_(live))
