"""Direct safetensors mapping for streamed blocks, guarded by a preflight.

`build_checkpoint_mmap_plan` proves, from checkpoint *metadata only*, that every
parameter and persistent buffer of the plan's blocks has exactly one checkpoint
entry with the same shape and dtype, and that the checkpoint has no block entry
the model lacks. Only then may block weights be read straight from the files
(memory-mapped by safetensors) instead of being materialised by the ordinary
loader. Any mismatch returns a plan-less result with the reason; the preflight
never raises for a checkpoint problem and never mutates the model.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .layout import persistent_buffers
from .plan import OffloadPlan, resolve_plan

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

CHECKPOINT_MMAP = "checkpoint_mmap"

KeyRemap = Callable[[str], "str | None"]
# A safetensors file, a directory of them (with or without an index), or a list of files.
CheckpointSource = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class TensorBinding:
    """Where one runtime tensor lives: a key inside one safetensors file."""

    checkpoint_key: str
    file_path: str


@dataclass(frozen=True)
class HostWeightPlan:
    """A preflighted mapping from runtime block-tensor names to checkpoint entries.

    Invariants: `bindings` covers every parameter and persistent buffer of the
    plan's blocks exactly once, with matching shape and dtype; `planned_prefixes`
    are the name prefixes the ordinary loader must skip.
    """

    backing_kind: str
    bindings: Mapping[str, TensorBinding]
    planned_prefixes: frozenset[str]

    def open(self) -> CheckpointReader:
        return CheckpointReader(self.bindings)


@dataclass(frozen=True)
class HostWeightPlanResult:
    plan: HostWeightPlan | None
    fallback_reason: str | None


class CheckpointReader:
    """Reads bound tensors through cached `safe_open` handles (memory-mapped, CPU)."""

    def __init__(self, bindings: Mapping[str, TensorBinding]) -> None:
        self._bindings = bindings
        self._handles: dict[str, object] = {}

    def get(self, runtime_name: str) -> torch.Tensor:
        binding = self._bindings.get(runtime_name)
        if binding is None:
            raise ValueError(
                f"the host-weight plan has no binding for {runtime_name!r}; build it with "
                "build_checkpoint_mmap_plan for this model and OffloadPlan"
            )
        handle = self._handles.get(binding.file_path)
        if handle is None:
            handle = safe_open(binding.file_path, framework="pt", device="cpu")
            self._handles[binding.file_path] = handle
        return handle.get_tensor(binding.checkpoint_key)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._handles.clear()


class _Incompatible(ValueError):
    """The checkpoint cannot back the blocks directly; the message is the fallback reason."""


def checkpoint_files(checkpoint: CheckpointSource) -> list[str]:
    """The safetensors files of a checkpoint: a file, a list of files, or a directory.

    A directory's ``*.safetensors.index.json`` is preferred over globbing.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            if indexes:
                weight_map = json.loads(indexes[0].read_text())["weight_map"]
                return [str(path / name) for name in sorted(set(weight_map.values()))]
            files = sorted(str(p) for p in path.glob("*.safetensors"))
            if not files:
                raise _Incompatible(f"no safetensors files were found in {str(path)!r}")
            return files
        candidates = [str(path)]
    else:
        candidates = [str(p) for p in checkpoint]
        if not candidates:
            raise _Incompatible("no safetensors files were given")
    return candidates


def _required_tensors(model: nn.Module, plan: OffloadPlan) -> dict[str, torch.Tensor]:
    resolved = resolve_plan(model, plan)
    required: dict[str, torch.Tensor] = {}
    for block_name, block in zip(resolved.block_names, resolved.blocks, strict=True):
        for name, tensor in (*block.named_parameters(), *persistent_buffers(block).items()):
            required[f"{block_name}.{name}"] = tensor
    if not required:
        raise _Incompatible("no block parameters or persistent buffers were discovered")
    return required


def _preflight(
    model: nn.Module, plan: OffloadPlan, checkpoint: CheckpointSource, remap: KeyRemap | None
) -> HostWeightPlan:
    required = _required_tensors(model, plan)
    block_prefixes = tuple(f"{path}." for path in plan.block_lists)
    where = block_prefixes[0] if len(block_prefixes) == 1 else block_prefixes
    bindings: dict[str, TensorBinding] = {}
    metadata: dict[str, tuple[str, list[int]]] = {}
    strays: list[str] = []
    for file_path in checkpoint_files(checkpoint):  # type: ignore[arg-type]
        if not Path(file_path).is_file():
            raise _Incompatible(f"checkpoint file does not exist: {file_path}")
        with safe_open(file_path, framework="pt", device="cpu") as handle:
            for key in handle.keys():
                name = remap(key) if remap is not None else key
                if name is None or not name.startswith(block_prefixes):
                    continue
                if name in bindings:
                    first = bindings[name]
                    raise _Incompatible(
                        f"multiple checkpoint entries map to runtime tensor {name!r}: "
                        f"{first.file_path}:{first.checkpoint_key} and {file_path}:{key}"
                    )
                if name not in required:
                    strays.append(name)
                    continue
                bindings[name] = TensorBinding(key, file_path)
                tensor_slice = handle.get_slice(key)
                metadata[name] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
    if not bindings and not strays:
        raise _Incompatible(f"no compatible safetensors entries under {where!r} were found in the checkpoint")
    missing = sorted(set(required) - set(bindings))
    if missing:
        raise _Incompatible(
            f"{len(missing)} required block tensors have no checkpoint binding (first 5: {missing[:5]})"
        )
    if strays:
        raise _Incompatible(
            f"{len(strays)} checkpoint entries under {where!r} match no block tensor (first 5: {sorted(strays)[:5]})"
        )
    for name, tensor in required.items():
        dtype_name, shape = metadata[name]
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise _Incompatible(f"unsupported safetensors dtype {dtype_name} for {name!r}")
        if shape != list(tensor.shape):
            raise _Incompatible(f"shape mismatch for {name!r}: checkpoint={shape}, runtime={list(tensor.shape)}")
        if dtype != tensor.dtype:
            raise _Incompatible(f"dtype mismatch for {name!r}: checkpoint={dtype}, runtime={tensor.dtype}")
    return HostWeightPlan(CHECKPOINT_MMAP, bindings, frozenset(block_prefixes))


def build_checkpoint_mmap_plan(
    model: nn.Module,
    plan: OffloadPlan,
    checkpoint: CheckpointSource,
    *,
    remap: KeyRemap | None = None,
) -> HostWeightPlanResult:
    """Preflight direct mapping of `plan`'s blocks from `checkpoint`.

    `remap` turns a checkpoint key into the runtime tensor name (None skips it).
    Returns ``(plan, None)`` on success or ``(None, reason)``; only an invalid
    `OffloadPlan` raises. The reason is also logged.
    """
    try:
        host_plan = _preflight(model, plan, checkpoint, remap)
    except (_Incompatible, OSError, SafetensorError, KeyError, json.JSONDecodeError) as exc:
        reason = str(exc) if isinstance(exc, _Incompatible) else f"{type(exc).__name__}: {exc}"
        logger.warning("DLO direct checkpoint mmap unavailable; using ordinary loader: %s", reason)
        return HostWeightPlanResult(None, reason)
    logger.info("DLO host-weight plan active: %d block tensors mapped from the checkpoint", len(host_plan.bindings))
    return HostWeightPlanResult(host_plan, None)


def load_checkpoint(
    model: nn.Module,
    plan: OffloadPlan,
    checkpoint: CheckpointSource,
    *,
    remap: KeyRemap | None = None,
) -> HostWeightPlanResult:
    """Load `checkpoint` into `model`, leaving block tensors to the mmap plan when it applies.

    On a preflight success, only tensors outside the planned prefixes are loaded
    (block tensors stay as they are, e.g. on meta) and the plan is returned for
    `enable_layerwise_offload(..., host_weights=...)`. Otherwise every tensor is
    loaded the ordinary way and the result carries the fallback reason. Either way
    every checkpoint entry must land on a model tensor and every model parameter
    and persistent buffer loaded must be covered, or a RuntimeError says which.
    """
    result = build_checkpoint_mmap_plan(model, plan, checkpoint, remap=remap)
    skip = result.plan.planned_prefixes if result.plan is not None else frozenset()
    state: dict[str, torch.Tensor] = {}
    for file_path in checkpoint_files(checkpoint):
        with safe_open(file_path, framework="pt", device="cpu") as handle:
            for key in handle.keys():
                name = remap(key) if remap is not None else key
                if name is not None and not any(name.startswith(p) for p in skip):
                    state[name] = handle.get_tensor(key)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not any(m.startswith(p) for p in skip)]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint does not match the model: missing {sorted(missing)[:5]} "
            f"({len(missing)} total), unexpected {sorted(unexpected)[:5]} ({len(unexpected)} total)"
        )
    return result
