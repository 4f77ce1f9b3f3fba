"""Diffusion pipelines for omni behind one model contract: the causal-prefix DiT family with the shipped
omni-shapes-tiny, real families from diffusers-layout checkpoints (FLUX.1, Qwen-Image; Wan 2.1 / 2.2 video), and
the two-stage music family with the shipped omni-tones-tiny.

- ``inspect(name) -> ModelSpec``: what a model is and accepts, from metadata alone;
- ``load(name, ...) -> StepwisePipeline``: any kind, through one registry (``omni_models.registry``);
- ``GenerationRequest`` / ``resolve_request(info, request)``: the one request type, checked once;
- ``StepwisePipeline`` / ``PagedPipeline`` (``omni_models.contract``): what an engine drives.

Everything but the error types is imported on first use, so ``omni_models.training`` (data, scorer, training
scripts; never imported by serving) works where only torch is installed, and nothing here imports diffusers or
transformers until a diffusers checkpoint is loaded (``omni_models.diffusers_adapter``, the ``diffusers`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_models.errors import CheckpointError, InvalidRequestError, MissingDependencyError

__version__ = "0.13.0"

if TYPE_CHECKING:
    from omni_models.contract import Job, PagedPipeline, StepwisePipeline
    from omni_models.families import FamilyJob, FamilyPipeline
    from omni_models.input_images import InputImage, decode_input_image
    from omni_models.lora import LoRAError, LoRAOptions
    from omni_models.pipeline import Pipeline
    from omni_models.prompts import PromptReader
    from omni_models.registry import LoadOptions, inspect, inspect_lora, load
    from omni_models.request import GenerationRequest, ResolvedRequest, resolve_request
    from omni_models.runner import GenerationJob
    from omni_models.spec import AudioLimits, Capabilities, ImageLimits, ModelInfo, ModelSpec, SizeRange, VideoLimits
    from omni_models.video import Video
    from omni_models.video_family import VideoFamilyPipeline, VideoJob

_LAZY = {
    "Job": "omni_models.contract",
    "PagedPipeline": "omni_models.contract",
    "StepwisePipeline": "omni_models.contract",
    "FamilyJob": "omni_models.families",
    "FamilyPipeline": "omni_models.families",
    "InputImage": "omni_models.input_images",
    "decode_input_image": "omni_models.input_images",
    "Pipeline": "omni_models.pipeline",
    "PromptReader": "omni_models.prompts",
    "LoadOptions": "omni_models.registry",
    "LoRAError": "omni_models.lora",
    "LoRAOptions": "omni_models.lora",
    "inspect": "omni_models.registry",
    "inspect_lora": "omni_models.registry",
    "load": "omni_models.registry",
    "GenerationRequest": "omni_models.request",
    "ResolvedRequest": "omni_models.request",
    "resolve_request": "omni_models.request",
    "GenerationJob": "omni_models.runner",
    "AudioLimits": "omni_models.spec",
    "Capabilities": "omni_models.spec",
    "ImageLimits": "omni_models.spec",
    "ModelInfo": "omni_models.spec",
    "ModelSpec": "omni_models.spec",
    "SizeRange": "omni_models.spec",
    "VideoLimits": "omni_models.spec",
    "Video": "omni_models.video",
    "VideoFamilyPipeline": "omni_models.video_family",
    "VideoJob": "omni_models.video_family",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omni_models' has no attribute {name!r}")


__all__ = [
    "AudioLimits",
    "Capabilities",
    "CheckpointError",
    "FamilyJob",
    "FamilyPipeline",
    "GenerationJob",
    "GenerationRequest",
    "ImageLimits",
    "InputImage",
    "InvalidRequestError",
    "Job",
    "LoadOptions",
    "LoRAError",
    "LoRAOptions",
    "MissingDependencyError",
    "ModelInfo",
    "ModelSpec",
    "PagedPipeline",
    "Pipeline",
    "PromptReader",
    "ResolvedRequest",
    "SizeRange",
    "StepwisePipeline",
    "Video",
    "VideoFamilyPipeline",
    "VideoJob",
    "VideoLimits",
    "__version__",
    "decode_input_image",
    "inspect",
    "inspect_lora",
    "load",
    "resolve_request",
]
