"""Keeps classifier-free-guidance cond/uncond request pairs step-locked in vLLM's v1 scheduler.

``import cfg_pairing`` does not import vLLM. `CFGPairingScheduler` and
`CFGPairingAsyncScheduler` (vLLM ``Scheduler`` / ``AsyncScheduler`` subclasses,
selected through ``SchedulerConfig.scheduler_cls``) import it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

from cfg_pairing.equalize import equalize_cfg_pair_progress
from cfg_pairing.install_gate import (
    cfg_scheduler_cls,
    configure_cfg_scheduler,
    sampling_extra_args_keys,
    stage_declares_cfg_pairs,
)
from cfg_pairing.pair_ids import (
    DEFAULT_UNCOND_SUFFIX,
    cfg_uncond_suffixes,
    register_cfg_uncond_suffix,
)
from cfg_pairing.scheduler import CFGPairingMixin

# Names resolved on first use, so that importing the package does not import vLLM.
_LAZY = {
    "CFGPairingScheduler": "cfg_pairing._vllm",
    "CFGPairingAsyncScheduler": "cfg_pairing._vllm",
    "PairGatedKVCacheManager": "cfg_pairing._vllm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cfg_pairing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CFGPairingAsyncScheduler",
    "CFGPairingMixin",
    "CFGPairingScheduler",
    "DEFAULT_UNCOND_SUFFIX",
    "PairGatedKVCacheManager",
    "__version__",
    "cfg_scheduler_cls",
    "cfg_uncond_suffixes",
    "configure_cfg_scheduler",
    "equalize_cfg_pair_progress",
    "register_cfg_uncond_suffix",
    "sampling_extra_args_keys",
    "stage_declares_cfg_pairs",
]
