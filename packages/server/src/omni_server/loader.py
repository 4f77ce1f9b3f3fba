"""Load a pipeline as the config says: weights, dtype, FP8 linears (fp8_cache), layerwise offload (dlo_offload).

The model declares what each library may do (``omni_models.integrations``: FP8-able linears, the offload
plan); this module only applies those declarations in the right order:

1. load the weights (on the host when offloading, else on the device);
2. FP8: swap the declared linears for ``FP8Linear`` -- from the on-disk cache when ``fp8_cache_dir`` holds a
   current artifact (built on first start, reused after), else by online quantization;
3. offload: stream the blocks from host memory (FP8 bytes when quantized), embeddings stay resident.
"""

from __future__ import annotations

import fnmatch
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
    from fp8_cache import FP8Linear, load_fp8_weights
    from fp8_cache.linear import unsupported_shape_reason
    from torch import nn

    from omni_models.hub import resolve_model_dir
    from omni_models.integrations import FP8_IGNORE

    model = pipeline.model
    sources = sorted(str(path) for path in resolve_model_dir(config.model).glob("*.safetensors"))
    device = next(model.parameters()).device
    # Exactly the weights quantize_model would swap: linears the model does not ignore, with FP8-able shapes
    # (name patterns alone would also match 2-D embedding tables).
    linears = [
        f"{name}.weight" for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(fnmatch.fnmatchcase(name, p) for p in FP8_IGNORE)
        and unsupported_shape_reason(module.in_features, module.out_features) is None
    ]
    result = load_fp8_weights(sources, config.fp8_cache_dir, device=device, quantize=linears)
    for weight_name in result.quantized:
        module_name = weight_name.removesuffix(".weight")
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear):
            raise RuntimeError(f"FP8 cache names {weight_name!r}, but {module_name} is a {type(linear).__name__}")
        parent_name, _, child = module_name.rpartition(".")
        fp8 = FP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device=device,
                        bias_dtype=linear.weight.dtype)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fp8)
    # load_state_dict copies into the existing parameters, so high-precision tensors keep the model's dtype.
    model.load_state_dict(result.tensors, strict=True)
    logger.info("FP8 cache %s: %s (%d FP8 linears)", config.fp8_cache_dir,
                "hit" if result.hit else f"miss ({result.reason})", len(result.quantized))
