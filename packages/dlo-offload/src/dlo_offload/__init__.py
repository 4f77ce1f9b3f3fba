"""Distributed layerwise offload: block weights on the host (pinned or mmap), sharded across ranks, streamed into two
device slots while the previous block computes.

Names are imported on first use (PEP 562), so a process that only checks a configuration
(``check_allgather_plan``) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.4.1"

# Each public name and the submodule that defines it.
_EXPORTS = {
    "HostWeightPlan": "checkpoint",
    "HostWeightPlanResult": "checkpoint",
    "TensorBinding": "checkpoint",
    "build_checkpoint_mmap_plan": "checkpoint",
    "load_checkpoint": "checkpoint",
    "LayerwiseOffload": "executor",
    "SlotState": "executor",
    "enable_layerwise_offload": "executor",
    "check_allgather_plan": "rules",
    "HostBlockStore": "host_store",
    "allocate_host_bytes": "host_store",
    "BlockLayout": "layout",
    "TensorEntry": "layout",
    "storage_span": "layout",
    "OffloadPlan": "plan",
    "ResolvedPlan": "plan",
    "resolve_plan": "plan",
    "DPWaveCoordinator": "wave",
    "WaveFailedError": "wave",
    "WaveRefusedError": "wave",
    "WaveRequest": "wave",
    "validate_wave": "wave",
}

__all__ = [
    "BlockLayout",
    "DPWaveCoordinator",
    "HostBlockStore",
    "HostWeightPlan",
    "HostWeightPlanResult",
    "LayerwiseOffload",
    "OffloadPlan",
    "ResolvedPlan",
    "SlotState",
    "TensorBinding",
    "TensorEntry",
    "WaveFailedError",
    "WaveRefusedError",
    "WaveRequest",
    "allocate_host_bytes",
    "build_checkpoint_mmap_plan",
    "check_allgather_plan",
    "enable_layerwise_offload",
    "load_checkpoint",
    "resolve_plan",
    "storage_span",
    "validate_wave",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlo_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .checkpoint import (
        HostWeightPlan,
        HostWeightPlanResult,
        TensorBinding,
        build_checkpoint_mmap_plan,
        load_checkpoint,
    )
    from .executor import LayerwiseOffload, SlotState, enable_layerwise_offload
    from .host_store import HostBlockStore, allocate_host_bytes
    from .layout import BlockLayout, TensorEntry, storage_span
    from .plan import OffloadPlan, ResolvedPlan, resolve_plan
    from .rules import check_allgather_plan
    from .wave import DPWaveCoordinator, WaveFailedError, WaveRefusedError, WaveRequest, validate_wave
