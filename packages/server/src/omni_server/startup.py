"""The checks before anything starts: the model's metadata, what it can do, and the libraries' own rules.

``check_startup`` runs in the CLI before ``serve`` spawns its engine and before ``generate`` loads anything. It
reads the model through ``omni_models.inspect`` (configs and safetensors headers, no tensor data, no device), then
asks each library whether the flags make sense together: ``omni_models.registry.check_load_options`` (FP8 and
offload options), ``dlo_offload.check_allgather_plan`` (resident blocks and AllGather), the model's capabilities
(``ModelSpec.capabilities``), every ``--lora-modules`` adapter against the model's metadata
(``omni_models.inspect_lora``: read, converted and checked, nothing loaded), a video model's MP4 encoder, and the
visible devices. ``check_video_dir`` checks ``serve``'s ``--video-dir`` for a video model. A failure is a
``ConfigError`` naming the flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_server.config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from omni_models import LoRAOptions, ModelSpec


def load_options(config: ServerConfig) -> dict[str, object]:
    """``omni_models.load`` keyword arguments of the config (device and dtype are resolved by the caller)."""
    return dict(
        quantization=config.quantization,
        fp8_cache_dir=config.fp8_cache_dir,
        layerwise_offload=config.enable_layerwise_offload,
        offload_resident_blocks=config.offload_resident_blocks,
        offload_allgather=config.offload_allgather,
    )


def compiles(config: ServerConfig, spec: ModelSpec) -> bool:
    """Whether the server compiles the model: on CUDA unless ``--enforce-eager``, for a kind that can
    (``capabilities.compile``), and never under layerwise offload (its hooks move weights between compiled
    blocks, so it runs eager)."""
    return (
        not config.enforce_eager
        and config.resolved_device().startswith("cuda")
        and spec.capabilities.compile
        and not config.enable_layerwise_offload
    )


def serving_options(config: ServerConfig, spec: ModelSpec) -> dict[str, object]:
    """``omni_models.load`` keyword arguments that depend on what the model is: compile (``compiles``) with its
    cache directory, the prompt-embedding cache and the forward's image-token budget (the kinds whose capabilities
    have them), and the attention's dtype (``check_startup`` refuses ``--attention-dtype fp8`` for a kind without
    FP8 attention)."""
    compiled = compiles(config, spec)
    return dict(
        compile=compiled,
        compile_cache_dir=config.compile_cache_dir if compiled else None,
        prompt_embed_cache_size=config.prompt_embed_cache_size if spec.capabilities.prompt_embed_cache else 0,
        max_batched_image_tokens=config.max_batched_image_tokens if spec.capabilities.batched_image_tokens else 0,
        attention_dtype=config.attention_dtype,
    )


def lora_options(config: ServerConfig) -> LoRAOptions | None:
    """``omni_models.load``'s ``lora`` argument of the config (None without ``--enable-lora``)."""
    if not config.enable_lora:
        return None
    from omni_models import LoRAOptions

    return LoRAOptions(max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras, max_rank=config.max_lora_rank)


def lora_error(name: str, error: Exception) -> ConfigError:
    """An adapter's refusal as the flag's error (``--lora-modules NAME: FILE: problem``)."""
    message = str(error)
    if "max_lora_rank" in message:
        message += " (--max-lora-rank)"
    return ConfigError(f"--lora-modules {name}: {message}")


def check_lora_modules(config: ServerConfig, spec: ModelSpec) -> None:
    """``--enable-lora`` needs a model that takes adapters; each ``--lora-modules`` file must serve it."""
    import omni_models

    if not spec.capabilities.lora:
        raise ConfigError(
            f"--enable-lora: {spec.info.variant} ({spec.kind}) does not support LoRA adapters; drop --enable-lora"
        )
    from omni_models.lora import is_target

    for module in config.lora_modules:
        try:
            weights = omni_models.inspect_lora(config.model, module.path, max_rank=config.max_lora_rank)
        except omni_models.LoRAError as exc:
            raise lora_error(module.name, exc) from None
        targets = config.lora_target_modules
        outside = [] if targets is None else sorted(n for n in weights.layers if not is_target(n, targets))
        if outside:
            raise ConfigError(
                f"--lora-modules {module.name}: {module.path}: holds layers for {len(outside)} linears outside "
                f"--lora-target-modules (e.g. {', '.join(outside[:3])})"
            )


# The flag behind each option name a library's message may use (load's options, dlo_offload's plan).
_FLAGS = {
    "quantization": "--quantization",
    "fp8_cache_dir": "--fp8-cache-dir",
    "layerwise_offload": "--enable-layerwise-offload",
    "resident_blocks": "--offload-resident-blocks",
    "allgather": "--offload-allgather",
}


def _library_rule(error: ValueError, config: ServerConfig) -> ConfigError:
    """A library's refusal, followed by the flags of the options it names that were given or that it asks for."""
    message = str(error)
    asked = " ".join(message.split("needs ", 1)[1:] + message.split("turn on ", 1)[1:])
    given = {
        "quantization": config.quantization is not None,
        "fp8_cache_dir": config.fp8_cache_dir is not None,
        "layerwise_offload": config.enable_layerwise_offload,
        "resident_blocks": config.offload_resident_blocks > 0,
        "allgather": config.offload_allgather,
    }
    flags = [flag for option, flag in _FLAGS.items() if option in message and (given[option] or option in asked)]
    return ConfigError(f"{message} ({', '.join(flags)})" if flags else message)


def check_devices(config: ServerConfig) -> None:
    """A CUDA device must be visible for ``--device cuda``; with several ranks, exactly one GPU per rank."""
    device = config.resolved_device()
    if not device.startswith("cuda"):
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        raise ConfigError(f"--device {device}: no CUDA device is visible on this machine; use --device cpu (or auto)")
    world = config.world_size
    if world > 1:
        if available != world:
            raise ConfigError(
                f"--cfg-parallel-size {config.cfg_parallel_size} x --sequence-parallel-size "
                f"{config.sequence_parallel_size} = {world} ranks, but {available} CUDA device(s) are visible; one "
                f"rank runs per GPU, so make CUDA_VISIBLE_DEVICES list exactly {world}"
            )
        if device != "cuda":
            raise ConfigError(
                f"--device {device} names one GPU, but {world} ranks use one GPU each; pass --device cuda"
            )
    elif ":" in device and int(device.split(":")[1]) >= available:
        raise ConfigError(f"--device {device}: only {available} CUDA device(s) are visible")


def check_startup(config: ServerConfig) -> ModelSpec:
    """Everything that can be checked before loading; returns the model's ``ModelSpec``.

    Raises ``ConfigError`` (flags), ``omni_models.CheckpointError`` (a bad checkpoint: the file and the problem) or
    ``omni_models.InvalidRequestError`` (a model name that resolves to nothing).
    """
    import omni_models
    from dlo_offload import check_allgather_plan
    from omni_models.registry import check_load_options

    try:
        check_load_options(**load_options(config))
        check_allgather_plan(config.offload_resident_blocks, use_allgather=config.offload_allgather)
    except ValueError as exc:
        raise _library_rule(exc, config) from None
    spec = omni_models.inspect(config.model)
    capabilities, variant = spec.capabilities, spec.info.variant
    for given, able, flag in (
        (config.quantization is not None, capabilities.fp8, "--quantization"),
        (config.enable_layerwise_offload, capabilities.layerwise_offload, "--enable-layerwise-offload"),
        (config.offload_allgather, capabilities.offload_allgather, "--offload-allgather"),
        (config.cfg_parallel_size > 1, capabilities.cfg_parallel, "--cfg-parallel-size"),
        (config.sequence_parallel_size > 1, capabilities.sequence_parallel, "--sequence-parallel-size"),
        (config.attention_dtype != "auto", capabilities.fp8_attention, "--attention-dtype"),
    ):
        if given and not able:
            raise ConfigError(f"{flag}: {variant} ({spec.kind}) does not support it; drop {flag}")
    if config.sequence_parallel_size > 1:
        from omni_models.parallel import check_sequence_parallel

        try:
            check_sequence_parallel(capabilities.attention_heads or 1, config.sequence_parallel_size)
        except ValueError as exc:
            raise ConfigError(f"--sequence-parallel-size: {exc}") from None
    default_cache = config.default_step_cache()
    if default_cache.enabled:
        from omni_models.step_cache import check_config

        try:
            check_config(default_cache, num_blocks=spec.info.transformer_blocks, num_steps=None, where="--step-cache")
        except ValueError as exc:
            raise ConfigError(f"{exc} ({variant} has {spec.info.transformer_blocks} repeated blocks)") from None
    if config.enable_lora:
        check_lora_modules(config, spec)
    if spec.info.task == "text-to-video":
        from omni_server import video_io

        if not video_io.available():
            raise ConfigError(video_io.MISSING_AV)
    check_devices(config)
    return spec


def check_video_dir(config: ServerConfig) -> None:
    """``serve`` of a video model keeps its videos in ``--video-dir``: a directory it can create and write."""
    import os

    directory = config.resolved_video_dir()
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--video-dir {directory}: {existing} is not a directory; pass a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--video-dir {directory}: {existing} is not writable by this server; pass one that is")
