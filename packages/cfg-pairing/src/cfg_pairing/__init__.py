"""Keeps classifier-free-guidance cond/uncond request pairs step-locked in vLLM's v1 Scheduler.

``import cfg_pairing`` does not import vLLM; `apply_cfg_patches` does.
"""

from __future__ import annotations

__version__ = "0.1.0"

from cfg_pairing._vllm import apply_cfg_patches, cfg_patches_applied, maybe_apply_cfg_scheduler_patches
from cfg_pairing.equalize import _equalize_cfg_pair_progress
from cfg_pairing.install_gate import sampling_extra_args_keys, stage_declares_cfg_pairs
from cfg_pairing.pair_ids import (
    DEFAULT_UNCOND_SUFFIX,
    cfg_uncond_suffixes,
    register_cfg_uncond_suffix,
)
from cfg_pairing.scheduler_patches import _patch_scheduler

__all__ = [
    "DEFAULT_UNCOND_SUFFIX",
    "__version__",
    "_equalize_cfg_pair_progress",
    "_patch_scheduler",
    "apply_cfg_patches",
    "cfg_patches_applied",
    "cfg_uncond_suffixes",
    "maybe_apply_cfg_scheduler_patches",
    "register_cfg_uncond_suffix",
    "sampling_extra_args_keys",
    "stage_declares_cfg_pairs",
]
