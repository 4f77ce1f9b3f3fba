"""The adapter between omni and diffusers/transformers: the only runtime module of omni_models importing them.

Install with ``pip install 'omni-models[diffusers]'``. Importing this module without them raises
``MissingDependencyError`` saying so; ``import omni_models`` and the shipped models never import it.

For any registered ``DiffusersFamily`` (``omni_models.backends``) it owns:
- ``inspect_family``: a metadata preflight of every component (configs, safetensors headers against a meta-device
  model built from each config, tokenizer files, the scheduler config) that raises ``CheckpointError`` naming the
  file before anything is allocated on a device, and the family's ``ModelSpec``;
- ``load_family``: materialization (transformer and VAE straight from safetensors into parameters built without
  initialisation; text encoders through transformers' ``from_pretrained``), FP8 (``fp8_cache``, online or from its
  on-disk cache), omni's attention processors, and layerwise offload (``dlo_offload``).
diffusers and transformers are the source of truth for the math: prompts are encoded by the diffusers pipeline's
own ``encode_prompt``, the schedule comes from the checkpoint's own scheduler config, the transformer and VAE are
diffusers' classes, images go through the pipeline's ``image_processor``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fp8_cache import SAFETENSORS_DTYPES
from omni_models.errors import CheckpointError, MissingDependencyError

try:
    import diffusers
    import transformers
except ImportError as exc:  # pragma: no cover - exercised only where the extra is missing
    raise MissingDependencyError(
        f"loading a diffusers checkpoint needs diffusers and transformers ({exc}); install them with "
        "pip install 'omni-models[diffusers]'"
    ) from exc

from omni_models.diffusers_layout import (
    ComponentEntry,
    ExpectedTensor,
    PipelineIndex,
    check_weights_match,
    read_config,
    read_pipeline_index,
    read_weight_headers,
    weight_files,
)
from omni_models.families import DiffusersBackend, DiffusersFamily, FamilyPipeline
from omni_models.integrations import FAMILY_ACTIVATION_SCALING, family_offload_plan, quantize_family_fp8
from omni_models.spec import Capabilities, ModelSpec

if TYPE_CHECKING:
    from omni_models.registry import LoadOptions

logger = logging.getLogger(__name__)

# The safetensors name of each non-floating dtype a model may hold (fp8_cache's table, inverted).
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items() if not dtype.is_floating_point}


LIBRARIES = {"diffusers": diffusers, "transformers": transformers}


def library_class(library: str, name: str) -> type:
    return getattr(LIBRARIES[library], name)


# --- building models without allocating or initialising their parameters ---------------------------------------


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta-device parameters (no memory, no init); buffers and other tensors stay real.

    ``torch.device("meta")`` would also turn buffers and plain tensor attributes (Qwen-Image's RoPE tables) into
    meta tensors, which no checkpoint restores, so only parameter registration is redirected here. accelerate's
    ``init_empty_weights(include_buffers=False)`` does not fit: it re-wraps every registered parameter, one already
    on the meta device too, so a weight tied after construction (transformers' ``tie_weights``: T5's shared
    embedding) comes out untied. This patches ``nn.Module.register_parameter`` for the duration and leaves meta
    parameters as they are: do not build modules on other threads meanwhile.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _expected(name_to_tensor: Mapping[str, Tensor]) -> dict[str, ExpectedTensor]:
    return {
        name: ExpectedTensor(tuple(t.shape), t.is_floating_point(), SAFETENSORS_NAMES.get(t.dtype))
        for name, t in name_to_tensor.items()
    }


# --- preflight ---------------------------------------------------------------------------------------------------


@dataclass
class PreflightedModel:
    entry: ComponentEntry
    cls: type
    config: Any  # a dict for diffusers models, a PretrainedConfig for transformers models
    files: list[Path]


def _config_error(entry: ComponentEntry, exc: Exception) -> CheckpointError:
    return CheckpointError(entry.directory / "config.json", f"cannot build {entry.class_name} from it ({exc})")


def _preflight_diffusers_model(entry: ComponentEntry, cls: type) -> PreflightedModel:
    config = read_config(entry)
    headers = read_weight_headers(entry)
    try:
        with torch.device("meta"):
            model = cls.from_config(config)
    except Exception as exc:  # a config the class cannot build from
        raise _config_error(entry, exc) from None
    check_weights_match(entry, headers, _expected(model.state_dict()))
    return PreflightedModel(entry, cls, config, weight_files(entry)[1])


def _checkpoint_names(model: nn.Module) -> dict[str, Tensor]:
    """The model's state under the names transformers writes to disk (its key conversions reverted)."""
    state = model.state_dict(keep_vars=True)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, dict(state))


def _preflight_transformers_model(entry: ComponentEntry, cls: type) -> PreflightedModel:
    read_config(entry)  # a missing or malformed config.json is named as such
    headers = read_weight_headers(entry)
    try:
        config = cls.config_class.from_pretrained(entry.directory, local_files_only=True)
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        raise _config_error(entry, exc) from None
    state = _checkpoint_names(model)
    # Tied weights (T5's shared embedding) are stored once, under any one of their names.
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    alternatives = {name: tuple(n for n in names if n != name) for names in by_tensor.values() for name in names}
    unexpected = check_weights_match(
        entry, headers, _expected(state), alternatives=alternatives, ignore_unexpected=True
    )
    quiet = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())]
    extra = [name for name in unexpected if not any(p.search(name) for p in quiet)]
    # Extra weights mean the config describes another architecture (more layers, another head); other extras
    # (buffers older transformers versions saved, such as CLIP's position_ids) are skipped, as transformers does.
    structural = [name for name in extra if name.endswith((".weight", ".bias"))]
    if structural:
        raise CheckpointError(
            headers[structural[0]].file,
            f"holds weights a model built from {entry.name}/config.json does not have: "
            f"{structural[:3]}{' ...' if len(structural) > 3 else ''}",
        )
    if extra:
        logger.warning(
            "%s: ignoring %d tensors %s does not use, e.g. %s", entry.directory, len(extra), entry.class_name, extra[:3]
        )
    return PreflightedModel(entry, cls, config, weight_files(entry)[1])


TOKENIZER_VOCABULARIES = ("tokenizer.json", "vocab.json", "spiece.model")


def _load_tokenizer(entry: ComponentEntry) -> Any:
    # transformers builds a default vocabulary from an empty directory; a checkpoint must carry its own.
    if not any((entry.directory / name).is_file() for name in TOKENIZER_VOCABULARIES):
        raise CheckpointError(
            entry.directory, f"cannot load the {entry.name}: no vocabulary file ({', '.join(TOKENIZER_VOCABULARIES)})"
        )
    cls = getattr(transformers, entry.class_name, None) or transformers.AutoTokenizer
    try:
        return cls.from_pretrained(entry.directory, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(entry.directory, f"cannot load the {entry.name} ({entry.class_name}): {exc}") from None


# --- Qwen2-VL's processor without torchvision ---------------------------------------------------------------------
#
# transformers' ``Qwen2VLImageProcessor`` runs on torchvision (and ``Qwen2VLProcessor`` insists on a video processor,
# which needs it too); PyPI's torchvision wheels do not load beside the CPU torch. The image edit families need only
# the image path, so omni builds the processor from transformers' PIL/numpy backend of the same image processor
# (``Qwen2VLImageProcessorPil``: smart resize, patchify, its config keys) with the two steps where the backends
# differ done the way the torchvision backend does them: the resize is torch's own antialiased uint8 bicubic
# interpolation (what ``torchvision.transforms.v2.functional.resize`` calls on a CPU uint8 image) and rescale and
# normalize are one ``(x - 255 mean) / (255 std)`` in float32 (the torchvision backend's fused form). Checked bitwise
# against the torchvision processor's ``pixel_values`` and ``image_grid_thw`` where torchvision loads
# (tests/omni_models/test_qwen_image_edit.py).


def _qwen2_vl_image_processor_class() -> type:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    class TorchQwen2VLImageProcessor(Qwen2VLImageProcessorPil):
        def resize(self, image: Any, size: Any, resample: Any, factor: int, **kwargs: Any) -> Any:
            import numpy as np

            height, width = image.shape[-2:]
            new_h, new_w = smart_resize(
                height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
            )
            if (new_h, new_w) == (height, width):
                return image
            pixels = torch.from_numpy(np.ascontiguousarray(image, dtype=np.uint8))[None]
            resized = torch.nn.functional.interpolate(
                pixels, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
            )
            return resized[0].numpy()

        def _preprocess(self, images: Any, **kwargs: Any) -> Any:
            if kwargs.get("do_rescale") and kwargs.get("do_normalize"):
                scale = 1.0 / kwargs["rescale_factor"]
                kwargs.update(
                    do_rescale=False,
                    image_mean=torch.tensor(kwargs["image_mean"]) * scale,
                    image_std=torch.tensor(kwargs["image_std"]) * scale,
                )
            return super()._preprocess(images, **kwargs)

        def normalize(self, image: Any, mean: Any, std: Any, **kwargs: Any) -> Any:
            import numpy as np

            x = torch.from_numpy(np.ascontiguousarray(image)).to(torch.float32)
            mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
            return ((x - mean) / std).numpy()

    TorchQwen2VLImageProcessor.__name__ = TorchQwen2VLImageProcessor.__qualname__ = "Qwen2VLImageProcessor"
    return TorchQwen2VLImageProcessor


def _qwen2_vl_processor_class() -> type:
    class ImageTextQwen2VLProcessor(transformers.Qwen2VLProcessor):
        """``Qwen2VLProcessor`` for images and text only (no video processor)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

    ImageTextQwen2VLProcessor.__name__ = ImageTextQwen2VLProcessor.__qualname__ = "Qwen2VLProcessor"
    return ImageTextQwen2VLProcessor


@functools.cache
def qwen2_vl_classes() -> tuple[type, type]:
    """(image processor class, processor class): Qwen2-VL's, without torchvision (see above)."""
    return _qwen2_vl_image_processor_class(), _qwen2_vl_processor_class()


def qwen2_vl_processor(tokenizer: Any, **image_processor_config: Any) -> Any:
    """A Qwen2-VL processor (images and text) over ``tokenizer``."""
    image_cls, processor_cls = qwen2_vl_classes()
    return processor_cls(image_processor=image_cls(**image_processor_config), tokenizer=tokenizer)


PROCESSOR_CLASSES = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")


def _load_processor(entry: ComponentEntry) -> Any:
    """A checkpoint's Qwen2-VL processor folder (``preprocessor_config.json`` and the tokenizer files) as the
    torchvision-free processor."""
    if entry.class_name not in PROCESSOR_CLASSES:
        raise CheckpointError(entry.directory, f"processor {entry.class_name} is not supported")
    # transformers 5 writes the image processor's config into processor_config.json; earlier releases (and the
    # published checkpoints) into preprocessor_config.json.
    if (entry.directory / "preprocessor_config.json").is_file():
        config_file = entry.directory / "preprocessor_config.json"
        config = read_config(entry, config_file.name)
    else:
        config_file = entry.directory / "processor_config.json"
        config = read_config(entry, config_file.name).get("image_processor")
        if not isinstance(config, dict):
            raise CheckpointError(config_file, "has no image_processor settings (and there is no preprocessor_config)")
    image_cls, processor_cls = qwen2_vl_classes()
    try:
        image_processor = image_cls.from_dict(
            {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
        )
    except Exception as exc:
        raise CheckpointError(config_file, f"cannot build the image processor ({exc})") from None
    tokenizer = _load_tokenizer(dataclasses.replace(entry, class_name="Qwen2Tokenizer"))
    return processor_cls(image_processor=image_processor, tokenizer=tokenizer)


def _load_scheduler(entry: ComponentEntry) -> Any:
    config = read_config(entry, "scheduler_config.json")
    try:
        return library_class("diffusers", entry.class_name).from_config(config)
    except Exception as exc:
        raise CheckpointError(
            entry.directory / "scheduler_config.json", f"cannot build the scheduler ({exc})"
        ) from None


def _check_components(index: PipelineIndex, family: DiffusersFamily) -> dict[str, ComponentEntry]:
    entries = {}
    for name, slot in family.slots.items():
        entry = index.components.get(name)
        if entry is None:
            if slot.optional:
                continue
            raise CheckpointError(index.path, f"has no {name!r} component; {family.pipeline_class} needs one")
        if entry.library != slot.library or entry.class_name not in slot.classes:
            raise CheckpointError(
                index.path,
                f"component {name!r} is [{entry.library!r}, {entry.class_name!r}]; {family.pipeline_class} is "
                f"supported with {slot.library} {' or '.join(slot.classes)}",
            )
        module = LIBRARIES[slot.library]
        if slot.kind not in ("tokenizer", "processor") and not hasattr(module, entry.class_name):
            raise CheckpointError(
                index.path,
                f"component {name!r} needs {entry.class_name}, which the installed "
                f"{slot.library} {module.__version__} does not have; upgrade it",
            )
        entries[name] = entry
    for name in index.components:
        if name not in family.slots:
            if name not in family.ignored:
                raise CheckpointError(index.path, f"component {name!r} is not part of {family.pipeline_class}")
            logger.info("%s: ignoring the optional %s component (not used by omni)", index.path, name)
    for name, value in index.settings.items():
        # A setting omni does not know is refused unless it is off (null or false: the feature is not used).
        if name not in family.settings and value not in (None, False):
            raise CheckpointError(
                index.path, f"{name}={value!r} is a {family.pipeline_class} setting omni does not support"
            )
    return entries


# --- materialisation ---------------------------------------------------------------------------------------------


def keeps_in_fp32(cls: type, name: str) -> bool:
    """Whether diffusers keeps parameter ``name`` of a ``cls`` model in float32 whatever the load dtype (the
    class's ``_keep_in_fp32_modules``, matched on the name's dotted parts as ``from_pretrained`` matches them:
    Wan's norms, time embedder and modulation tables)."""
    keep = getattr(cls, "_keep_in_fp32_modules", None) or ()
    parts = name.split(".")
    return any(module in parts for module in keep)


def _new_diffusers_model(preflighted: PreflightedModel, dtype: torch.dtype) -> nn.Module:
    with parameters_on_meta():
        model = preflighted.cls.from_config(preflighted.config)
    return nn.Module.to(model, dtype=dtype)  # diffusers' own .to() would warn about keep-in-fp32 modules it lacks


def _load_diffusers_model(preflighted: PreflightedModel, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from safetensors.torch import load_file

    model = _new_diffusers_model(preflighted, dtype)
    state: dict[str, Tensor] = {}
    for file in preflighted.files:
        for name, tensor in load_file(str(file), device=str(device)).items():
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if keeps_in_fp32(preflighted.cls, name) else dtype)
            state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def _load_fp8_transformer(
    preflighted: PreflightedModel,
    family: DiffusersFamily,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path,
    component: str = "transformer",
) -> tuple[nn.Module, Any]:
    """A denoiser (the ``component`` slot) with FP8 linears from ``fp8_cache``'s on-disk cache (built from the
    checkpoint on a miss)."""
    from fp8_cache import load_fp8_state_dict, load_fp8_weights

    result = load_fp8_weights(
        [str(f) for f in preflighted.files],
        cache_dir,
        device=device,
        component=component,
        ignore=family.declaration.fp8_ignore,
    )
    logger.info("FP8 cache %s: %s", cache_dir, "hit" if result.hit else f"miss ({result.reason})")
    model = _new_diffusers_model(preflighted, dtype)
    report = load_fp8_state_dict(model, result.tensors, activation_scaling=FAMILY_ACTIVATION_SCALING)
    return model.to(device).eval().requires_grad_(False), report


def load_fp8_transformer_component(
    directory: Path, family: DiffusersFamily, *, device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> tuple[nn.Module, Any]:
    """A family transformer saved on its own (``save_pretrained``: config.json + safetensors) with FP8 linears from
    ``fp8_cache``'s on-disk cache in ``cache_dir`` (built from its safetensors on a miss); preflighted like a
    pipeline component. Returns the transformer and the ``QuantizationReport``."""
    slot = family.slots["transformer"]
    class_name = read_config(ComponentEntry("transformer", slot.library, slot.classes[0], directory)).get("_class_name")
    if class_name not in slot.classes:
        raise CheckpointError(
            directory / "config.json",
            f"_class_name {class_name!r} is not a {family.name} transformer ({' or '.join(slot.classes)})",
        )
    entry = ComponentEntry("transformer", slot.library, class_name, directory)
    preflighted = _preflight_diffusers_model(entry, library_class(slot.library, class_name))
    return _load_fp8_transformer(preflighted, family, device=device, dtype=dtype, cache_dir=cache_dir)


def _load_transformers_model(preflighted: PreflightedModel, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model = preflighted.cls.from_pretrained(preflighted.entry.directory, dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False)


def _named_class(qualified: str) -> type:
    module, _, name = qualified.partition(":")
    return getattr(importlib.import_module(module), name)


def backend_class(family: DiffusersFamily) -> type[DiffusersBackend]:
    return _named_class(family.backend)


def family_attends_in_omni(family: DiffusersFamily) -> bool:
    """Whether the family's denoisers attend through omni's processors (``omni_models.family_attention``), which
    take ``attention_dtype``."""
    return backend_class(family).attention_processor is not None


def build_family_pipeline(
    family: DiffusersFamily,
    components: Mapping[str, Any],
    *,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int | None = None,
    offload: Any = None,
    fp8: Any = None,
    prompt_embed_cache_size: int = 0,
    max_batched_image_tokens: int = 0,
    offloads: Mapping[str, Any] | None = None,
    attention_dtype: str = "auto",
) -> FamilyPipeline:
    """A ``FamilyPipeline`` (the family's ``pipeline`` class) over already-loaded diffusers/transformers components
    (the diffusers pipeline's constructor arguments, with its settings). omni's attention processors are installed
    on every denoiser, for families that have their own, attending in ``attention_dtype`` ("auto" or "fp8": only
    those families). ``offloads``: each offloaded denoiser's ``LayerwiseOffload`` by slot (``offload`` alone: the
    ``transformer``'s)."""
    pipeline = library_class("diffusers", family.pipeline_class)(**components)
    length = max_sequence_length or family.default_max_sequence_length(pipeline.transformer.config)
    if not 1 <= length <= family.max_sequence_length_limit:
        raise ValueError(f"max_sequence_length must be in [1, {family.max_sequence_length_limit}], got {length}")
    backend_cls = backend_class(family)
    if not family_attends_in_omni(family) and attention_dtype != "auto":
        raise ValueError(f"attention_dtype: the {family.name} family attends through diffusers' own processors")
    if backend_cls.attention_processor is not None:
        for slot in family.denoisers:
            if getattr(pipeline, slot, None) is not None:
                getattr(pipeline, slot).set_attn_processor(backend_cls.attention_processor(attention_dtype))
    backend = backend_cls(pipeline, device=device, dtype=dtype, max_sequence_length=length)
    offloads = dict(offloads or ({} if offload is None else {"transformer": offload}))
    pipeline_cls = FamilyPipeline if family.pipeline is None else _named_class(family.pipeline)
    built = pipeline_cls(
        backend,
        name=name,
        device=device,
        dtype=dtype,
        offload=offloads.get("transformer"),
        fp8=fp8,
        prompt_embed_cache_size=prompt_embed_cache_size,
        max_batched_image_tokens=max_batched_image_tokens,
    )
    built.offloads = offloads
    return built


@dataclass
class PreflightedCheckpoint:
    """A checkpoint whose metadata passed every check: its model components (config and weight files checked
    against a meta-device model), and its tokenizers and scheduler (host objects, already built)."""

    family: DiffusersFamily
    models: dict[str, PreflightedModel]
    host_components: dict[str, Any]
    settings: dict[str, Any]  # the family's settings (model_index.json values; None where absent)

    def configs(self) -> dict[str, Any]:
        """The config of every diffusers model component, by slot (what ``check_configs`` reads)."""
        return {name: model.config for name, model in self.models.items() if model.entry.library == "diffusers"}


def preflight_family_checkpoint(family: DiffusersFamily, directory: Path) -> PreflightedCheckpoint:
    """Check a diffusers checkpoint of ``family`` without reading any tensor data or touching a device.

    Raises ``CheckpointError`` (one line: the file and the problem) for a missing/truncated/corrupt shard, an
    unknown component class, a config that disagrees with its weights, or components that do not fit each other.
    Reads JSON, safetensors headers and tokenizer files.
    """
    index = read_pipeline_index(directory)
    if index.class_name != family.pipeline_class:
        raise CheckpointError(index.path, f"is a {index.class_name}, not a {family.pipeline_class}")
    entries = _check_components(index, family)
    models: dict[str, PreflightedModel] = {}
    host_components: dict[str, Any] = {}
    for slot_name, slot in family.slots.items():
        entry = entries.get(slot_name)
        if entry is None:
            continue  # an optional component the checkpoint leaves out
        if slot.kind == "model":
            cls = library_class(slot.library, entry.class_name)
            preflight = _preflight_diffusers_model if slot.library == "diffusers" else _preflight_transformers_model
            models[slot_name] = preflight(entry, cls)
        elif slot.kind == "tokenizer":
            host_components[slot_name] = _load_tokenizer(entry)
        elif slot.kind == "processor":
            host_components[slot_name] = _load_processor(entry)
        else:
            host_components[slot_name] = _load_scheduler(entry)
    settings = {name: index.settings.get(name) for name in family.settings}
    checked = PreflightedCheckpoint(family, models, host_components, settings)
    problem = family.check_configs(checked.configs(), settings)
    if problem is not None:
        raise CheckpointError(models["transformer"].entry.directory / "config.json", problem)
    return checked


def inspect_family(family: DiffusersFamily, directory: Path, name: str) -> ModelSpec:
    """The family checkpoint's ``ModelSpec`` after its metadata preflight (``preflight_family_checkpoint``)."""
    checked = preflight_family_checkpoint(family, directory)
    transformer, vae = checked.models["transformer"].config, checked.models["vae"].config
    return ModelSpec(
        kind=family.name,
        directory=str(directory),
        info=family.info(name, transformer, vae, None, checked.settings),
        capabilities=Capabilities(
            fp8=True,
            layerwise_offload=True,
            offload_allgather=False,
            cfg_parallel=family.cfg_parallel,
            sequence_parallel=family.sequence_parallel,
            attention_heads=int(transformer.get("num_attention_heads", 1)),
            compile=family.compile,
            prompt_embed_cache=True,
            batched_image_tokens=True,
            lora=family.lora,
            fp8_attention=family_attends_in_omni(family),
        ),
    )


def _merged_report(reports: Mapping[str, Any]) -> Any:
    """One ``QuantizationReport`` for every quantized denoiser (the ``transformer``'s names as they are, another
    slot's prefixed with it); None without FP8."""
    if not reports:
        return None
    if list(reports) == ["transformer"]:
        return reports["transformer"]
    from fp8_cache import QuantizationReport

    merged = QuantizationReport()
    for slot, report in reports.items():
        prefix = "" if slot == "transformer" else f"{slot}."
        merged.quantized += [prefix + name for name in report.quantized]
        merged.skipped.update({prefix + name: why for name, why in report.skipped.items()})
    return merged


def load_family(family: DiffusersFamily, directory: Path, name: str, options: LoadOptions) -> FamilyPipeline:
    """Preflight every component (raising ``CheckpointError`` before touching the device), then load.

    ``options.quantization="fp8"`` swaps the transformer's linears for FP8 linears (the family's ``fp8_ignore``
    stays high precision): from ``options.fp8_cache_dir`` when it holds a current artifact (a warm start reads only
    the cache, never the bf16 shards; a miss quantizes and publishes it), else online. ``options.layerwise_offload``
    keeps the transformer's blocks in host memory and streams them through two device slots (``pipe.offload``).
    ``options.compile`` compiles the repeated blocks and the VAE decoder (``FamilyPipeline.compile``; the first
    forward of each shape compiles); ``options.prompt_embed_cache_size`` keeps that many prompts' embeddings;
    ``options.max_batched_image_tokens`` caps a forward's batch (``FamilyPipeline.forward_parts``).
    ``options.lora`` adds LoRA slots and hooks on the transformer's linears, after FP8 and offload
    (``pipe.lora``: ``omni_models.lora_files.enable_family_lora``).
    """
    unsupported = [
        name
        for name, given in (
            ("offload_allgather", options.offload_allgather),
            ("attention_backend", options.attention_backend is not None),
            ("cuda_graphs", options.cuda_graphs),
        )
        if given
    ]
    unsupported += [
        name
        for name, given, supported in (
            ("lora", options.lora is not None, family.lora),
            ("compile", options.compile, family.compile),
            ("attention_dtype", options.attention_dtype != "auto", family_attends_in_omni(family)),
        )
        if given and not supported
    ]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: not supported by the {family.name} family (ModelSpec.capabilities says what "
            "each family takes)"
        )
    checked = preflight_family_checkpoint(family, directory)
    models, host_components = checked.models, checked.host_components
    device, dtype = options.device, options.dtype
    loaded: dict[str, Any] = {}
    try:
        transformer_device = torch.device("cpu") if options.layerwise_offload else device
        denoisers = [slot for slot in family.denoisers if slot in models]
        for slot_name, preflighted in models.items():
            if slot_name in denoisers:
                continue
            load = _load_diffusers_model if preflighted.entry.library == "diffusers" else _load_transformers_model
            component_dtype = torch.float32 if slot_name in family.float32_components else dtype
            loaded[slot_name] = load(preflighted, device=device, dtype=component_dtype)
        reports = {}
        offloads = {}
        for slot_name in denoisers:
            if options.quantization == "fp8" and options.fp8_cache_dir is not None:
                loaded[slot_name], reports[slot_name] = _load_fp8_transformer(
                    models[slot_name],
                    family,
                    device=transformer_device,
                    dtype=dtype,
                    # One artifact per cache directory: a second denoiser's lives in a subdirectory named after it.
                    cache_dir=Path(options.fp8_cache_dir) / ("" if slot_name == "transformer" else slot_name),
                    component=slot_name,
                )
            else:
                loaded[slot_name] = _load_diffusers_model(models[slot_name], device=transformer_device, dtype=dtype)
                if options.quantization == "fp8":
                    reports[slot_name] = quantize_family_fp8(family.declaration, loaded[slot_name])
            if options.layerwise_offload:
                from dlo_offload import enable_layerwise_offload

                offloads[slot_name] = enable_layerwise_offload(
                    loaded[slot_name],
                    family_offload_plan(family.declaration, options.offload_resident_blocks),
                    device=device,
                    use_allgather=False,
                )
        pipeline = build_family_pipeline(
            family,
            {**host_components, **checked.settings, **loaded},
            name=name,
            device=device,
            dtype=dtype,
            max_sequence_length=options.max_sequence_length,
            offloads=offloads,
            fp8=_merged_report(reports),
            prompt_embed_cache_size=options.prompt_embed_cache_size,
            max_batched_image_tokens=options.max_batched_image_tokens,
            attention_dtype=options.attention_dtype,
        )
        if options.lora is not None:
            from omni_models.lora_files import enable_family_lora

            enable_family_lora(pipeline, family, options.lora)
        if options.compile:
            from omni_models.compilation import CompileSettings

            pipeline.compile(CompileSettings(backend=options.compile_backend))
        return pipeline
    except BaseException:
        loaded.clear()  # drop every component loaded so far, so a failed load leaves no device memory behind
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise
