"""The causal-prefix DiT family (the shipped ``omni-shapes-tiny``): a directory of ``config.json``, ``vocab.json``
and safetensors weights.

The model declares what each of omni's libraries may do (``omni_models.integrations``: FP8-able linears, the
offload plan); ``load`` applies those declarations in order, without ever materializing weights it will throw
away:

1. build the model on the meta device (no memory, no initialisation);
2. FP8 with ``fp8_cache_dir``: take the runtime tensors (FP8 linears and their scales, everything else in high
   precision) from the cache and install them directly -- a warm start reads only the cache's bytes, never the
   checkpoint's shards (their size and mtime are the cache's fingerprint); a miss quantizes the shards once and
   publishes the cache. Otherwise the checkpoint's tensors are installed, then quantized online;
3. offload: the blocks stay in host memory and stream to the device; the ``LayerwiseOffload`` handle is kept on
   the pipeline (``pipeline.offload``), and the pipeline computes on the device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from omni_models.checkpoint import load_config, load_weights_into, weight_files
from omni_models.config import dit_info
from omni_models.errors import CheckpointError
from omni_models.spec import Capabilities, ModelSpec
from omni_models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from omni_models.pipeline import Pipeline
    from omni_models.registry import LoadOptions

logger = logging.getLogger(__name__)


def inspect(directory: Path, name: str) -> ModelSpec:
    try:
        config, vocabulary = load_config(directory)
        files = weight_files(directory)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(directory, f"not a loadable omni model: {exc}") from None
    for file in files:
        if not file.is_file():
            raise CheckpointError(file, "weight shard is missing")
    return ModelSpec(
        kind="omni-dit",
        directory=str(directory),
        info=dit_info(config, vocabulary[2:], name),
        capabilities=Capabilities(
            fp8=True,
            layerwise_offload=True,
            offload_allgather=True,
            cfg_parallel=True,
            sequence_parallel=True,
            attention_heads=config.num_heads,
            compile=True,
        ),
    )


def load(directory: Path, name: str, options: LoadOptions) -> Pipeline:
    if options.lora is not None:
        raise ValueError("lora: LoRA adapters apply to the diffusers families (FLUX.1, Qwen-Image), not the DiT")
    if options.attention_dtype != "auto":
        raise ValueError(
            "attention_dtype applies to the diffusers families (FLUX.1, Qwen-Image, Wan); the DiT's attention is "
            "its paged K/V cache's"
        )
    if options.max_sequence_length is not None:
        raise ValueError(
            "max_sequence_length applies to the diffusers families; a causal-prefix DiT reads its "
            "config's max_prompt_tokens"
        )
    if options.prompt_embed_cache_size:
        raise ValueError(
            "prompt_embed_cache_size applies to the diffusers families; a causal-prefix DiT keeps each prompt's "
            "K/V in its paged cache instead"
        )
    if options.max_batched_image_tokens:
        raise ValueError(
            "max_batched_image_tokens applies to the diffusers families; the DiT's forwards are bounded by its paged "
            "K/V pool"
        )
    inspect(directory, name)  # a bad directory fails here, before anything is built
    # Imported here: ``inspect`` (the server's API process checks a model with it) reads metadata without torch.
    import torch

    from omni_models.integrations import FP8_IGNORE, offload_plan, quantize_fp8
    from omni_models.pipeline import Pipeline, build_model

    device, dtype = options.device, options.dtype
    if options.compile and device.type != "cuda":
        raise ValueError(
            f"compile: a causal-prefix DiT compiles to CUDA graphs, which need a CUDA device (got {device})"
        )
    weights_device = torch.device("cpu") if options.layerwise_offload else device
    config, vocabulary = load_config(directory)
    with torch.device("meta"):
        model = build_model(config).to(dtype)
    if options.quantization == "fp8" and options.fp8_cache_dir is not None:
        from fp8_cache import fp8_weight_names, load_fp8_state_dict, load_fp8_weights

        # Exactly the weights online quantization would swap, so a hit equals quantize_fp8 bit for bit.
        linears = fp8_weight_names(model, ignore=FP8_IGNORE)
        result = load_fp8_weights(
            [str(f) for f in weight_files(directory)], options.fp8_cache_dir, device=weights_device, quantize=linears
        )
        report = load_fp8_state_dict(model, result.tensors)
        logger.info(
            "FP8 cache %s: %s (%d FP8 linears)",
            options.fp8_cache_dir,
            "hit" if result.hit else f"miss ({result.reason})",
            len(report.quantized),
        )
    else:
        load_weights_into(model, directory, name=config.name)
        model.to(device=weights_device, dtype=dtype)
        if options.quantization == "fp8":
            report = quantize_fp8(model)
            logger.info("FP8: quantized %d linears online", len(report.quantized))
    model.to(weights_device)
    handle = None
    if options.layerwise_offload:
        from dlo_offload import enable_layerwise_offload

        handle = enable_layerwise_offload(
            model,
            offload_plan(options.offload_resident_blocks),
            device=device,
            group=options.offload_group,
            use_allgather=options.offload_allgather,
        )
        logger.info("layerwise offload: blocks stream to %s, %d resident", device, options.offload_resident_blocks)
    return Pipeline(
        model,
        Tokenizer(vocabulary, max_tokens=config.max_prompt_tokens),
        device=device,
        dtype=dtype,
        name=name,
        attention_backend=options.attention_backend or "paged",
        # Compiled serving of the DiT is its CUDA graphs (its fused Triton ops are on in every mode).
        cuda_graphs=options.cuda_graphs or options.compile,
        offload=handle,
    )
