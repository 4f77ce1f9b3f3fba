"""Diffusion pipelines for omni: the causal-prefix DiT family with the shipped omni-shapes-tiny model, and real
families (FLUX.1, Qwen-Image) from diffusers-layout checkpoints.

``load``, ``Pipeline`` (which need ``diffusion_kv``) and ``FamilyPipeline`` are imported on first use, so
``omni_models.training`` (data, scorer, training script; never imported by serving) works on a machine where only
torch is installed, and nothing here imports diffusers or transformers until a diffusers checkpoint is loaded
(``omni_models.diffusers_adapter``, the ``diffusers`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_models.errors import CheckpointError, InvalidRequestError, MissingDependencyError

__version__ = "0.6.0"

if TYPE_CHECKING:
    from omni_models.families import FamilyInfo, FamilyJob, FamilyPipeline, FamilyRequest, PromptConditioning
    from omni_models.pipeline import Pipeline, PipelineInfo, load
    from omni_models.runner import GenerationJob, GenerationRequest, GenerationRow, ScheduledJob

_LAZY = {
    "FamilyInfo": "omni_models.families",
    "FamilyJob": "omni_models.families",
    "FamilyPipeline": "omni_models.families",
    "FamilyRequest": "omni_models.families",
    "PromptConditioning": "omni_models.families",
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


__all__ = ["CheckpointError", "FamilyInfo", "FamilyJob", "FamilyPipeline", "FamilyRequest", "GenerationJob",
           "GenerationRequest", "GenerationRow", "InvalidRequestError", "MissingDependencyError", "Pipeline",
           "PipelineInfo", "PromptConditioning", "ScheduledJob", "load", "__version__"]
