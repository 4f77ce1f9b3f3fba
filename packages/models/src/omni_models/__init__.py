"""Diffusion pipelines for omni, starting with the causal-prefix DiT family and the shipped omni-shapes-tiny model.

``load`` and ``Pipeline`` (which need ``diffusion_kv``) are imported on first use, so the training and scoring
modules work on a machine where only torch is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_models.errors import InvalidRequestError

__version__ = "0.2.0"

if TYPE_CHECKING:
    from omni_models.pipeline import Pipeline, PipelineInfo, load
    from omni_models.runner import GenerationJob, GenerationRequest, GenerationRow, ScheduledJob

_LAZY = {
    "load": "omni_models.pipeline",
    "Pipeline": "omni_models.pipeline",
    "PipelineInfo": "omni_models.pipeline",
    "GenerationJob": "omni_models.runner",
    "GenerationRequest": "omni_models.runner",
    "GenerationRow": "omni_models.runner",
    "ScheduledJob": "omni_models.runner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omni_models' has no attribute {name!r}")


__all__ = ["GenerationJob", "GenerationRequest", "GenerationRow", "InvalidRequestError", "Pipeline",
           "PipelineInfo", "ScheduledJob", "load", "__version__"]
