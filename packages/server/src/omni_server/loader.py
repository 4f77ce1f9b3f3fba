"""Load a pipeline as the config says: weights, dtype, FP8 linears (fp8_cache), layerwise offload (dlo_offload).

The model declares what each library may do (``omni_models.integrations``: FP8-able linears, the offload
plan); this module only applies those declarations in the right order:

1. load the weights (on the host when offloading, else on the device);
2. FP8: swap the declared linears for ``FP8Linear`` -- from the on-disk cache when ``fp8_cache_dir`` holds a
   current artifact (built on first start, reused after), else by online quantization;
3. offload: stream the blocks from host memory (FP8 bytes when quantized), embeddings stay resident.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_server.config import ServerConfig

logger = logging.getLogger("omni_server.loader")


def load_pipeline(config: ServerConfig) -> Any:
    import torch

    from omni_models import load

    device = torch.device(config.resolved_device())
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    offload = config.enable_layerwise_offload
    pipeline = load(config.model, device="cpu" if offload else device, dtype=dtype)
    if config.quantization == "fp8":
        if config.fp8_cache_dir is not None:
            _install_cached_fp8(pipeline, config)
        else:
            from omni_models.integrations import quantize_fp8

            report = quantize_fp8(pipeline.model)
            logger.info("FP8: quantized %d linears online", len(report.quantized))
    if offload:
        from dlo_offload import enable_layerwise_offload

        from omni_models.integrations import offload_plan

        enable_layerwise_offload(pipeline.model, offload_plan(config.offload_resident_layers), device=device,
                                 use_allgather=False)
        # The pipeline places latents and KV caches on its device: rebind it to the compute device.
        pipeline = type(pipeline)(pipeline.model, pipeline.tokenizer, device=device, dtype=dtype)
        logger.info("layerwise offload: blocks stream to %s, %d resident", device, config.offload_resident_layers)
    return pipeline


def _install_cached_fp8(pipeline: Any, config: ServerConfig) -> None:
    """Replace the declared linears with ``FP8Linear``s holding the cached (or freshly quantized) FP8 weights."""
    from fp8_cache import fp8_weight_names, load_fp8_state_dict, load_fp8_weights

    from omni_models.hub import resolve_model_dir
    from omni_models.integrations import FP8_IGNORE

    model = pipeline.model
    sources = sorted(str(path) for path in resolve_model_dir(config.model).glob("*.safetensors"))
    device = next(model.parameters()).device
    # Exactly the weights online quantization would swap, so a hit equals quantize_fp8 bit for bit.
    linears = fp8_weight_names(model, ignore=FP8_IGNORE)
    result = load_fp8_weights(sources, config.fp8_cache_dir, device=device, quantize=linears)
    report = load_fp8_state_dict(model, result.tensors)
    logger.info("FP8 cache %s: %s (%d FP8 linears)", config.fp8_cache_dir,
                "hit" if result.hit else f"miss ({result.reason})", len(report.quantized))
