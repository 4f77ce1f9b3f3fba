"""LoRA adapter files for the diffusers families, read through diffusers' and PEFT's own code.

The one module that reads adapter files (it imports diffusers and peft: the ``lora`` extra). A file is a
``.safetensors`` LoRA, or a directory holding one (``pytorch_lora_weights.safetensors``, or its only
``.safetensors`` file), as diffusers' ``load_lora_weights`` takes it:

1. the family pipeline's own ``lora_state_dict`` (``FluxPipeline``'s ``FluxLoraLoaderMixin``,
   ``QwenImagePipeline``'s ``QwenImageLoraLoaderMixin``) reads it and converts the community layouts (kohya's
   ``lora_unet_*`` / ``lora_down``, xlabs, ...) to diffusers' keys, folding kohya's alphas;
2. the transformer's layers are put in PEFT's layout (``convert_unet_state_dict_to_peft``) and its
   ``LoraConfig`` is built as diffusers builds it (the file's ``lora_adapter_metadata``, else ``get_peft_kwargs``
   from the ranks and alphas), so each layer's scaling is PEFT's: ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``) with
   ``rank_pattern``/``alpha_pattern`` matched by PEFT's ``get_pattern_key``;
3. every layer is checked against the transformer: the module exists and is a linear, its shapes match, its rank
   is within ``max_rank``, its values are finite.

Anything that would make diffusers skip a layer silently or serve something else (text-encoder layers, no
transformer layers at all, DoRA, LoRA biases, Control LoRAs) is a ``LoRAError`` naming the file instead.
"""

from __future__ import annotations

import inspect as pyinspect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from omni_models.errors import MissingDependencyError
from omni_models.lora import LoRAError, LoRALayer, LoRAOptions, LoRARuntime, LoRAWeights, lora_targets

try:
    import diffusers
    import peft
except ImportError as exc:  # pragma: no cover - exercised only where the extra is missing
    raise MissingDependencyError(
        f"LoRA adapters need diffusers and peft ({exc}); install them with pip install 'omni-models[lora]'"
    ) from exc

if TYPE_CHECKING:
    from omni_models.families import DiffusersFamily, FamilyPipeline

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
PREFIX = "transformer."
Targets = Mapping[str, tuple[int, int]]  # module name -> (in_features, out_features)


def adapter_file(path: Path) -> Path:
    """The ``.safetensors`` file of ``path`` (a file, or a directory holding one); ``LoRAError`` otherwise."""
    if path.is_dir():
        if (path / DEFAULT_WEIGHT_NAME).is_file():
            return path / DEFAULT_WEIGHT_NAME
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            found = f"{len(files)} ({', '.join(f.name for f in files)})" if files else "none"
            raise LoRAError(
                path,
                f"a LoRA directory must hold {DEFAULT_WEIGHT_NAME} or exactly one .safetensors file; found {found}",
            )
        return files[0]
    if not path.is_file():
        raise LoRAError(path, "no such LoRA file or directory")
    if path.suffix != ".safetensors":
        raise LoRAError(path, "LoRA adapters are read from .safetensors files only (no pickled checkpoints)")
    return path


def _read_state_dict(family: DiffusersFamily, file: Path) -> tuple[dict[str, Tensor], dict[str, Any], Any]:
    """(state dict in diffusers' keys, network alphas, adapter metadata) through the family's ``lora_state_dict``."""
    loader = getattr(diffusers, family.pipeline_class).lora_state_dict
    wants_alphas = "return_alphas" in pyinspect.signature(loader).parameters
    try:
        out = loader(
            str(file.parent),
            weight_name=file.name,
            use_safetensors=True,  # never fall back to unpickling
            local_files_only=True,
            return_lora_metadata=True,
            **({"return_alphas": True} if wants_alphas else {}),
        )
    except Exception as exc:  # safetensors' header/size errors, a converter refusing the keys, ...
        raise LoRAError(file, f"cannot be read as a LoRA adapter: {type(exc).__name__}: {exc}") from None
    state_dict, alphas, metadata = out if wants_alphas else (out[0], None, out[1])
    return dict(state_dict), dict(alphas or {}), metadata


def _transformer_layers(file: Path, state_dict: Mapping[str, Tensor], family: DiffusersFamily) -> dict[str, Tensor]:
    """The transformer's entries of ``state_dict`` (prefix stripped), refusing whatever would not be applied."""
    others = sorted(k for k in state_dict if not k.startswith(PREFIX))
    if any(k.startswith("text_encoder") for k in others):
        example = next(k for k in others if k.startswith("text_encoder"))
        raise LoRAError(
            file,
            f"holds LoRA layers for a text encoder (e.g. {example}); omni applies adapters to the transformer only",
        )
    if others:
        raise LoRAError(
            file,
            f"holds entries that are not {family.pipeline_class} transformer LoRA layers (e.g. {others[0]}); is it an "
            f"adapter for another base model?",
        )
    layers = {k.removeprefix(PREFIX): v for k, v in state_dict.items()}
    if not layers:
        raise LoRAError(file, "holds no LoRA layers")
    not_lora = sorted(k for k in layers if "lora" not in k)
    if not_lora:
        raise LoRAError(
            file,
            f"holds non-LoRA weights for the transformer (e.g. {not_lora[0]}: a Control LoRA or a full module); only "
            "LoRA layers are served",
        )
    from diffusers.utils import convert_unet_state_dict_to_peft

    if not any(".lora_A." in k for k in layers):
        layers = convert_unet_state_dict_to_peft(layers)
    for key in layers:
        if "lora_magnitude_vector" in key or "dora_scale" in key:
            raise LoRAError(file, f"is a DoRA adapter ({key}); only plain LoRA is served")
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise LoRAError(file, f"has an entry omni does not serve: {key} (LoRA biases, embeddings, LoKr, ...)")
    return layers


def _config(file: Path, layers: Mapping[str, Tensor], alphas: Mapping[str, Any], metadata: Any) -> Any:
    """The adapter's ``peft.LoraConfig``, built as diffusers' ``load_lora_adapter`` builds it."""
    from diffusers.utils.peft_utils import get_peft_kwargs

    alphas = {k.removeprefix(PREFIX): v for k, v in alphas.items() if k.startswith(PREFIX)}
    if metadata is not None:  # diffusers then takes the transformer's entries as LoraConfig's arguments as they are
        kwargs = {k.removeprefix(PREFIX): v for k, v in metadata.items() if k.startswith(PREFIX)}
    else:
        ranks = {f"^{k}": v.shape[1] for k, v in layers.items() if k.endswith(".lora_B.weight")}
        kwargs = get_peft_kwargs(ranks, alphas, layers, is_unet=True)
    try:
        config = peft.LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise LoRAError(file, f"has LoRA metadata PEFT's LoraConfig refuses: {exc}") from None
    if config.use_dora:
        raise LoRAError(file, "is a DoRA adapter (use_dora); only plain LoRA is served")
    if getattr(config, "lora_bias", False):
        raise LoRAError(file, "has LoRA biases (lora_bias); omni serves bias-free LoRA")
    return config


def read_lora(
    family: DiffusersFamily, path: Path, targets: Targets, *, max_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """One adapter file as ``LoRAWeights`` for a transformer whose linears are ``targets``; ``LoRAError`` naming
    the file for anything that would not serve it as diffusers + PEFT would."""
    from peft.utils.other import get_pattern_key

    file = adapter_file(Path(path))
    state_dict, alphas, metadata = _read_state_dict(family, file)
    layers = _transformer_layers(file, state_dict, family)
    config = _config(file, layers, alphas, metadata)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in layers})
    missing = [m for m in modules if m not in targets]
    if missing:
        raise LoRAError(
            file,
            f"targets {len(missing)} of its {len(modules)} modules that the {family.name} transformer does not have "
            f"as linears (e.g. {', '.join(missing[:3])}); is it an adapter for another base model?",
        )
    out: dict[str, LoRALayer] = {}
    for module in modules:
        down, up = layers.get(f"{module}.lora_A.weight"), layers.get(f"{module}.lora_B.weight")
        if down is None or up is None:
            raise LoRAError(file, f"{module} has only one of lora_A and lora_B")
        in_features, out_features = targets[module]
        rank = down.shape[0]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != rank:
            raise LoRAError(
                file, f"{module}: lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} are not a rank-r pair"
            )
        if down.shape[1] != in_features or up.shape[0] != out_features:
            raise LoRAError(
                file,
                f"was made for another base model: {module} maps {down.shape[1]} -> {up.shape[0]} features in the "
                f"adapter and {in_features} -> {out_features} in this {family.name} transformer",
            )
        if rank > max_rank:
            raise LoRAError(
                file, f"has rank {rank} ({module}), above the largest rank this server holds (max_lora_rank={max_rank})"
            )
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        if r != rank:
            raise LoRAError(file, f"{module} has rank {rank} but its LoRA config says {r}")
        if not (torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise LoRAError(file, f"{module} holds NaN or infinite values")
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        out[module] = LoRALayer(down.to(dtype).contiguous(), up.to(dtype).contiguous(), float(scaling))
    return LoRAWeights(out)


def _linear_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (m.in_features, m.out_features) for name, m in lora_targets(module).items()}


def checkpoint_targets(family: DiffusersFamily, directory: Path) -> dict[str, tuple[int, int]]:
    """The transformer's linears from a checkpoint's metadata alone (a meta-device model built from its config)."""
    from omni_models.diffusers_adapter import _config_error, library_class
    from omni_models.diffusers_layout import read_config, read_pipeline_index

    entry = read_pipeline_index(directory).components["transformer"]
    cls = library_class(family.slots["transformer"].library, entry.class_name)
    try:
        with torch.device("meta"):
            model = cls.from_config(read_config(entry))
    except Exception as exc:
        raise _config_error(entry, exc) from None
    return _linear_shapes(model)


def inspect_family_lora(family: DiffusersFamily, directory: Path, path: Path, *, max_rank: int) -> LoRAWeights:
    """Read and check an adapter against a checkpoint without loading the model (the server's start-up check)."""
    return read_lora(family, path, checkpoint_targets(family, directory), max_rank=max_rank, dtype=torch.float32)


def enable_family_lora(pipeline: FamilyPipeline, family: DiffusersFamily, options: LoRAOptions) -> LoRARuntime:
    """Give ``pipeline`` a ``LoRARuntime`` over its transformer (after FP8 and offload, which swap or move its
    linears): ``pipeline.lora``."""
    targets = _linear_shapes(pipeline.transformer)

    def read(path: Path) -> LoRAWeights:
        return read_lora(family, path, targets, max_rank=options.max_rank, dtype=pipeline.dtype)

    pipeline.lora = LoRARuntime(pipeline.transformer, read, options, device=pipeline.device, dtype=pipeline.dtype)
    return pipeline.lora


__all__ = ["adapter_file", "checkpoint_targets", "enable_family_lora", "inspect_family_lora", "read_lora"]
