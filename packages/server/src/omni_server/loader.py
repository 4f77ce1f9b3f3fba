"""Load a pipeline as the config says: weights, dtype, FP8 linears (fp8_cache), layerwise offload (dlo_offload).

Two kinds of model directory:

- a diffusers checkpoint (FLUX.1, Qwen-Image): ``omni_models.load`` does it all (preflight of every component,
  then FP8 from the cache or online with the family's ignore list, then offload of the family's block lists);
- an omni model (the shipped ``omni-shapes-tiny`` or a directory like it), loaded here. The model declares what
  each library may do (``omni_models.integrations``: FP8-able linears, the offload plan); this module applies
  those declarations in order, without ever materializing weights it will throw away:

  1. build the model on the meta device (no memory, no initialisation);
  2. FP8 with ``fp8_cache_dir``: take the runtime tensors (FP8 linears and their scales, everything else in high
     precision) from the cache and install them directly -- a warm start reads only the cache's bytes, never the
     checkpoint's shards (their size and mtime are the cache's fingerprint); a miss quantizes the shards once and
     publishes the cache. Otherwise the checkpoint's tensors are installed, then quantized online with ``--quantization fp8``;
  3. offload: the blocks stay in host memory and stream to the device; the ``LayerwiseOffload`` handle is kept
     on the pipeline (``pipeline.offload``), and the pipeline computes on the device.

Nothing is placed on the device before the checkpoint's metadata is checked (``check_model``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omni_server.config import ServerConfig

logger = logging.getLogger("omni_server.loader")


def check_model(config: ServerConfig) -> Path:
    """Resolve the model and check its metadata without reading tensor data or touching a device.

    Raises ``omni_models.CheckpointError`` (one line: file and problem) for a bad checkpoint, and
    ``omni_models.InvalidRequestError`` (param ``model``) for a name that resolves to nothing.
    """
    from omni_models.hub import is_diffusers_checkpoint, resolve_model_dir

    directory = resolve_model_dir(config.model)
    if is_diffusers_checkpoint(directory):
        from omni_models.diffusers_adapter import preflight_family_checkpoint

        preflight_family_checkpoint(directory)
    else:
        _check_omni_model(directory)
    return directory


def resolve_dtype(config: ServerConfig, device: Any) -> Any:
    import torch

    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def load_pipeline(config: ServerConfig) -> Any:
    """A ``Pipeline`` (omni model) or ``FamilyPipeline`` (diffusers checkpoint) ready on the configured device."""
    import torch

    from omni_models import load
    from omni_models.hub import is_diffusers_checkpoint, resolve_model_dir

    device = torch.device(config.resolved_device())
    dtype = resolve_dtype(config, device)
    directory = resolve_model_dir(config.model)
    if is_diffusers_checkpoint(directory):
        pipeline = load(config.model, device=device, dtype=dtype, quantization=config.quantization,
                        fp8_cache_dir=config.fp8_cache_dir, layerwise_offload=config.enable_layerwise_offload,
                        offload_resident_blocks=config.offload_resident_layers)
        logger.info("loaded %s (%s) on %s, %s%s%s", config.model, pipeline.info.variant, device, dtype,
                    ", FP8" if pipeline.fp8 is not None else "", ", layerwise offload" if pipeline.offload else "")
        return pipeline
    return _load_omni_model(directory, config, device=device, dtype=dtype)


def _check_omni_model(directory: Path) -> None:
    from omni_models import CheckpointError
    from omni_models.checkpoint import load_config, weight_files

    try:
        load_config(directory)
        files = weight_files(directory)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(directory, f"not a loadable omni model: {exc}") from None
    for file in files:
        if not file.is_file():
            raise CheckpointError(file, "weight shard is missing")


def _load_omni_model(directory: Path, config: ServerConfig, *, device: Any, dtype: Any) -> Any:
    import torch

    from omni_models import Pipeline
    from omni_models.checkpoint import load_config, load_weights_into, weight_files
    from omni_models.integrations import FP8_IGNORE, offload_plan, quantize_fp8
    from omni_models.pipeline import build_model
    from omni_models.tokenizer import Tokenizer

    offload = config.enable_layerwise_offload
    weights_device = torch.device("cpu") if offload else device
    model_config, vocabulary = load_config(directory)
    with torch.device("meta"):
        model = build_model(model_config).to(dtype)
    if config.quantization == "fp8" and config.fp8_cache_dir is not None:
        from fp8_cache import fp8_weight_names, load_fp8_state_dict, load_fp8_weights

        # Exactly the weights online quantization would swap, so a hit equals quantize_fp8 bit for bit.
        linears = fp8_weight_names(model, ignore=FP8_IGNORE)
        result = load_fp8_weights([str(f) for f in weight_files(directory)], config.fp8_cache_dir,
                                  device=weights_device, quantize=linears)
        report = load_fp8_state_dict(model, result.tensors)
        logger.info("FP8 cache %s: %s (%d FP8 linears)", config.fp8_cache_dir,
                    "hit" if result.hit else f"miss ({result.reason})", len(report.quantized))
    else:
        load_weights_into(model, directory, name=model_config.name)
        model.to(device=weights_device, dtype=dtype)
        if config.quantization == "fp8":
            report = quantize_fp8(model)
            logger.info("FP8: quantized %d linears online", len(report.quantized))
    model.to(weights_device)
    handle = None
    if offload:
        from dlo_offload import enable_layerwise_offload

        group = None
        if config.offload_allgather:  # the DLO group of the worker group's rank layout (SP when DP is 1)
            from dlo_offload import get_model_parallel_groups, select_dlo_group

            group = select_dlo_group(get_model_parallel_groups())
        handle = enable_layerwise_offload(model, offload_plan(config.offload_resident_layers), device=device,
                                          group=group, use_allgather=config.offload_allgather)
        logger.info("layerwise offload: blocks stream to %s, %d resident", device, config.offload_resident_layers)
    return Pipeline(model, Tokenizer(vocabulary, max_tokens=model_config.max_prompt_tokens), device=device,
                    dtype=dtype, offload=handle)
