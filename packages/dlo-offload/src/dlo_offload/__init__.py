"""Distributed layerwise offload: block weights on the host (pinned or mmap), sharded across ranks, streamed into two
device slots while the previous block computes."""

from __future__ import annotations

from .checkpoint import (
    HostWeightPlan,
    HostWeightPlanResult,
    TensorBinding,
    build_checkpoint_mmap_plan,
    load_checkpoint,
)
from .executor import LayerwiseOffload, SlotState, check_allgather_plan, enable_layerwise_offload
from .host_store import HostBlockStore, allocate_host_bytes
from .layout import BlockLayout, TensorEntry, storage_span
from .plan import OffloadPlan, ResolvedPlan, resolve_plan
from .wave import DPWaveCoordinator, WaveFailedError, WaveRefusedError, WaveRequest, validate_wave

__version__ = "0.4.0"

__all__ = [
    "BlockLayout",
    "DPWaveCoordinator",
    "WaveFailedError",
    "WaveRefusedError",
    "WaveRequest",
    "validate_wave",
    "HostBlockStore",
    "HostWeightPlan",
    "HostWeightPlanResult",
    "LayerwiseOffload",
    "OffloadPlan",
    "ResolvedPlan",
    "SlotState",
    "TensorBinding",
    "TensorEntry",
    "allocate_host_bytes",
    "build_checkpoint_mmap_plan",
    "check_allgather_plan",
    "enable_layerwise_offload",
    "load_checkpoint",
    "resolve_plan",
    "storage_span",
]
