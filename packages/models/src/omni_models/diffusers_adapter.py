"""The adapter between omni and diffusers/transformers: the only runtime module of omni_models importing them.

Install with ``pip install 'omni-models[diffusers]'``. Importing this module without them raises
``MissingDependencyError`` saying so; ``import omni_models`` and the shipped model never import it.

It owns:
- the family table: which ``model_index.json`` pipeline class is which family, and which component classes
  each slot may hold;
- loading: a metadata preflight of every component (configs, safetensors headers against a meta-device model
  built from each config) that raises ``CheckpointError`` before anything is allocated on the target device,
  then materialization (transformer and VAE straight from safetensors into parameters built without
  initialisation; text encoders through transformers' ``from_pretrained``), FP8 (``fp8_cache``, online or from
  its on-disk cache), omni's attention processors, and layerwise offload (``dlo_offload``);
- the per-family backends ``FamilyPipeline`` drives. diffusers and transformers are the source of truth: prompts
  are encoded by the diffusers pipeline's own ``encode_prompt``, the schedule comes from the checkpoint's own
  scheduler config through diffusers' ``retrieve_timesteps``/``calculate_shift``, the transformer and VAE are
  diffusers' classes, images go through the pipeline's ``image_processor``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from omni_models.errors import CheckpointError, MissingDependencyError

try:
    import diffusers
    import transformers
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
except ImportError as exc:  # pragma: no cover - exercised only where the extra is missing
    raise MissingDependencyError(
        f"loading a diffusers checkpoint needs diffusers and transformers ({exc}); install them with "
        "pip install 'omni-models[diffusers]'"
    ) from exc

from omni_models.diffusers_layout import (
    ComponentEntry,
    ExpectedTensor,
    PipelineIndex,
    TensorHeader,
    check_weights_match,
    read_config,
    read_pipeline_index,
    read_weight_headers,
    weight_files,
)
from omni_models.families import (
    MAX_IMAGES_PER_REQUEST,
    DenoiseRow,
    FamilyInfo,
    FamilyName,
    FamilyPipeline,
    TextEmbedding,
)
from omni_models.family_attention import OmniFluxAttnProcessor, OmniQwenImageAttnProcessor
from omni_models.integrations import FAMILY_DECLARATIONS, family_offload_plan
from omni_models.limits import MAX_INFERENCE_STEPS

logger = logging.getLogger(__name__)

ComponentKind = Literal["model", "tokenizer", "scheduler"]
SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32",
                      torch.int64: "I64"}


@dataclass(frozen=True)
class Slot:
    library: str
    classes: tuple[str, ...]
    kind: ComponentKind


@dataclass(frozen=True)
class FamilySpec:
    family: FamilyName
    pipeline_class: str
    slots: Mapping[str, Slot]
    ignored: tuple[str, ...] = ()  # optional components the family never uses (e.g. FLUX's IP-adapter encoder)


FAMILIES: dict[str, FamilySpec] = {
    spec.pipeline_class: spec
    for spec in (
        FamilySpec(
            family="flux",
            pipeline_class="FluxPipeline",
            slots={
                "transformer": Slot("diffusers", ("FluxTransformer2DModel",), "model"),
                "vae": Slot("diffusers", ("AutoencoderKL",), "model"),
                "text_encoder": Slot("transformers", ("CLIPTextModel",), "model"),
                "text_encoder_2": Slot("transformers", ("T5EncoderModel",), "model"),
                "tokenizer": Slot("transformers", ("CLIPTokenizer", "CLIPTokenizerFast"), "tokenizer"),
                "tokenizer_2": Slot("transformers", ("T5Tokenizer", "T5TokenizerFast"), "tokenizer"),
                "scheduler": Slot("diffusers", ("FlowMatchEulerDiscreteScheduler",), "scheduler"),
            },
            ignored=("image_encoder", "feature_extractor"),
        ),
        FamilySpec(
            family="qwen-image",
            pipeline_class="QwenImagePipeline",
            slots={
                "transformer": Slot("diffusers", ("QwenImageTransformer2DModel",), "model"),
                "vae": Slot("diffusers", ("AutoencoderKLQwenImage",), "model"),
                "text_encoder": Slot("transformers", ("Qwen2_5_VLForConditionalGeneration",), "model"),
                "tokenizer": Slot("transformers", ("Qwen2Tokenizer", "Qwen2TokenizerFast"), "tokenizer"),
                "scheduler": Slot("diffusers", ("FlowMatchEulerDiscreteScheduler",), "scheduler"),
            },
        ),
    )
}


LIBRARIES = {"diffusers": diffusers, "transformers": transformers}


def library_class(library: str, name: str) -> type:
    return getattr(LIBRARIES[library], name)


# --- building models without allocating or initialising their parameters ---------------------------------------


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta-device parameters (no memory, no init); buffers and other tensors stay real.

    ``torch.device("meta")`` would also turn buffers and plain tensor attributes (Qwen-Image's RoPE tables) into
    meta tensors, which no checkpoint restores, so only parameter registration is redirected here. It patches
    ``nn.Module.register_parameter`` for the duration: do not build modules on other threads meanwhile.
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
        name: ExpectedTensor(tuple(t.shape), t.is_floating_point(), SAFETENSORS_DTYPES.get(t.dtype))
        for name, t in name_to_tensor.items()
    }


# --- preflight ---------------------------------------------------------------------------------------------------


@dataclass
class PreflightedModel:
    entry: ComponentEntry
    cls: type
    config: Any                    # a dict for diffusers models, a PretrainedConfig for transformers models
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
    unexpected = check_weights_match(entry, headers, _expected(state), alternatives=alternatives,
                                      ignore_unexpected=True)
    quiet = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())]
    extra = [name for name in unexpected if not any(p.search(name) for p in quiet)]
    # Extra weights mean the config describes another architecture (more layers, another head); other extras
    # (buffers older transformers versions saved, such as CLIP's position_ids) are skipped, as transformers does.
    structural = [name for name in extra if name.endswith((".weight", ".bias"))]
    if structural:
        raise CheckpointError(headers[structural[0]].file,
                              f"holds weights a model built from {entry.name}/config.json does not have: "
                              f"{structural[:3]}{' ...' if len(structural) > 3 else ''}")
    if extra:
        logger.warning("%s: ignoring %d tensors %s does not use, e.g. %s", entry.directory, len(extra),
                       entry.class_name, extra[:3])
    return PreflightedModel(entry, cls, config, weight_files(entry)[1])


TOKENIZER_VOCABULARIES = ("tokenizer.json", "vocab.json", "spiece.model")


def _load_tokenizer(entry: ComponentEntry) -> Any:
    # transformers builds a default vocabulary from an empty directory; a checkpoint must carry its own.
    if not any((entry.directory / name).is_file() for name in TOKENIZER_VOCABULARIES):
        raise CheckpointError(entry.directory, f"cannot load the {entry.name}: no vocabulary file "
                                               f"({', '.join(TOKENIZER_VOCABULARIES)})")
    cls = getattr(transformers, entry.class_name, None) or transformers.AutoTokenizer
    try:
        return cls.from_pretrained(entry.directory, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(entry.directory, f"cannot load the {entry.name} ({entry.class_name}): {exc}") from None


def _load_scheduler(entry: ComponentEntry) -> Any:
    config = read_config(entry, "scheduler_config.json")
    try:
        return library_class("diffusers", entry.class_name).from_config(config)
    except Exception as exc:
        raise CheckpointError(entry.directory / "scheduler_config.json", f"cannot build the scheduler ({exc})") from None


def _check_components(index: PipelineIndex, spec: FamilySpec) -> dict[str, ComponentEntry]:
    entries = {}
    for name, slot in spec.slots.items():
        entry = index.components.get(name)
        if entry is None:
            raise CheckpointError(index.path, f"has no {name!r} component; {spec.pipeline_class} needs one")
        if entry.library != slot.library or entry.class_name not in slot.classes:
            raise CheckpointError(
                index.path,
                f"component {name!r} is [{entry.library!r}, {entry.class_name!r}]; {spec.pipeline_class} is supported "
                f"with {slot.library} {' or '.join(slot.classes)}",
            )
        module = LIBRARIES[slot.library]
        if slot.kind != "tokenizer" and not hasattr(module, entry.class_name):
            raise CheckpointError(index.path, f"component {name!r} needs {entry.class_name}, which the installed "
                                              f"{slot.library} {module.__version__} does not have; upgrade it")
        entries[name] = entry
    for name in index.components:
        if name not in spec.slots:
            if name not in spec.ignored:
                raise CheckpointError(index.path, f"component {name!r} is not part of {spec.pipeline_class}")
            logger.info("%s: ignoring the optional %s component (not used by omni)", index.path, name)
    return entries


def _check_family_configs(spec: FamilySpec, models: Mapping[str, PreflightedModel]) -> None:
    transformer, vae = models["transformer"], models["vae"]
    config, vae_config = transformer.config, vae.config
    where = transformer.entry.directory / "config.json"
    in_channels = config.get("in_channels", 64)
    if in_channels % 4:
        raise CheckpointError(where, f"in_channels={in_channels} is not 4 x the latent channels (2x2 packing)")
    latent_channels = vae_config.get("latent_channels" if spec.family == "flux" else "z_dim")
    if in_channels // 4 != latent_channels:
        raise CheckpointError(where, f"in_channels={in_channels} needs a VAE with {in_channels // 4} latent channels, "
                                     f"but {vae.entry.name}/config.json has {latent_channels}")
    if spec.family == "qwen-image":
        for option in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if config.get(option):
                raise CheckpointError(where, f"{option}=true (a Qwen-Image edit/distilled variant) is not supported")


# --- materialisation ---------------------------------------------------------------------------------------------


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
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def _load_fp8_transformer(
    preflighted: PreflightedModel, family: FamilyName, *, device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> tuple[nn.Module, Any]:
    """The transformer with FP8 linears from ``fp8_cache``'s on-disk cache (built from the checkpoint on a miss)."""
    from fp8_cache import load_fp8_state_dict, load_fp8_weights

    result = load_fp8_weights([str(f) for f in preflighted.files], cache_dir, device=device, component="transformer",
                              ignore=FAMILY_DECLARATIONS[family].fp8_ignore)
    logger.info("FP8 cache %s: %s", cache_dir, "hit" if result.hit else f"miss ({result.reason})")
    model = _new_diffusers_model(preflighted, dtype)
    report = load_fp8_state_dict(model, result.tensors)
    return model.to(device).eval().requires_grad_(False), report


def load_fp8_transformer_component(
    directory: Path, family: FamilyName, *, device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> tuple[nn.Module, Any]:
    """A family transformer saved on its own (``save_pretrained``: config.json + safetensors) with FP8 linears from
    ``fp8_cache``'s on-disk cache in ``cache_dir`` (built from its safetensors on a miss); preflighted like a
    pipeline component. Returns the transformer and the ``QuantizationReport``."""
    slot = next(s for s in FAMILIES.values() if s.family == family).slots["transformer"]
    class_name = read_config(ComponentEntry("transformer", slot.library, slot.classes[0], directory)).get("_class_name")
    if class_name not in slot.classes:
        raise CheckpointError(directory / "config.json", f"_class_name {class_name!r} is not a {family} transformer "
                                                         f"({' or '.join(slot.classes)})")
    entry = ComponentEntry("transformer", slot.library, class_name, directory)
    preflighted = _preflight_diffusers_model(entry, library_class(slot.library, class_name))
    return _load_fp8_transformer(preflighted, family, device=device, dtype=dtype, cache_dir=cache_dir)


def _load_transformers_model(preflighted: PreflightedModel, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model = preflighted.cls.from_pretrained(preflighted.entry.directory, dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False)


# --- the family backends -----------------------------------------------------------------------------------------


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]`` (2x2 patches, the families' token layout)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of ``pack_latents`` for latent ``height`` x ``width``."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)


class _Backend:
    """What both families share: geometry, the schedule, initial latents."""

    family: FamilyName
    block_lists: tuple[str, ...]
    max_sequence_length_limit: int

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype, max_sequence_length: int) -> None:
        self.pipeline = pipeline
        self.transformer: nn.Module = pipeline.transformer
        self.device, self.dtype = device, dtype
        self.vae_scale_factor: int = pipeline.vae_scale_factor
        self.latent_channels: int = self.transformer.config.in_channels // 4
        self.max_sequence_length = max_sequence_length
        self.block_lists = FAMILY_DECLARATIONS[self.family].block_lists

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.vae_scale_factor * 2
        return 2 * (height // factor), 2 * (width // factor)

    def _info(self, name: str, **family_fields: Any) -> FamilyInfo:
        multiple = self.vae_scale_factor * 2
        default = self.pipeline.default_sample_size * self.vae_scale_factor
        return FamilyInfo(
            name=name, family=self.family, pixel_multiple=multiple, min_side=multiple, max_side=2 * default,
            default_height=default, default_width=default, max_inference_steps=MAX_INFERENCE_STEPS,
            max_images_per_request=MAX_IMAGES_PER_REQUEST, max_sequence_length=self.max_sequence_length, negative_prompt=True,
            true_cfg=True, **family_fields,
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one backend per loaded pipeline
    def schedule(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """(sigmas [n + 1], timesteps [n]) as the diffusers pipeline computes them for this size, float32 on CPU."""
        config = self.pipeline.scheduler.config
        scheduler = type(self.pipeline.scheduler).from_config(config)
        latent_h, latent_w = self.latent_size(height, width)
        mu = calculate_shift(
            (latent_h // 2) * (latent_w // 2), config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.family == "flux" and config.get("use_flow_sigmas", False):
            sigmas = None
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(torch.float32), timesteps.to(torch.float32)

    def initial_latents(self, seed: int, height: int, width: int) -> Tensor:
        """diffusers' draw for ``generator=torch.Generator("cpu").manual_seed(seed)``, packed: ``[S, 4C]``."""
        latent_h, latent_w = self.latent_size(height, width)
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn((1, self.latent_channels, latent_h, latent_w), generator=generator, dtype=self.dtype)
        return pack_latents(noise)[0].to(self.device)

    def _timesteps(self, rows: Sequence[DenoiseRow]) -> Tensor:
        # diffusers feeds ``t.to(latents.dtype) / 1000``; the same two ops keep bf16 runs identical.
        return torch.stack([row.timestep for row in rows]).to(self.device).to(self.dtype) / 1000

    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        return uncond + scale * (cond - uncond)

    def _postprocess(self, image: Tensor) -> list[Image.Image]:
        return self.pipeline.image_processor.postprocess(image, output_type="pil")


class FluxBackend(_Backend):
    family = "flux"
    max_sequence_length_limit = 512

    def describe(self, name: str) -> FamilyInfo:
        dev = bool(self.transformer.config.guidance_embeds)
        return self._info(
            name, variant="flux.1-dev" if dev else "flux.1-schnell", default_steps=28 if dev else 4,
            default_true_cfg_scale=1.0, embedded_guidance=dev, default_guidance_scale=3.5 if dev else None,
        )

    def encode(self, prompt: str) -> TextEmbedding:
        tokens, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompt, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return TextEmbedding(tokens[0], pooled[0])

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def _image_ids(self, height: int, width: int) -> Tensor:
        latent_h, latent_w = self.latent_size(height, width)
        ids = torch.zeros(latent_h // 2, latent_w // 2, 3)
        ids[..., 1] += torch.arange(latent_h // 2)[:, None]
        ids[..., 2] += torch.arange(latent_w // 2)[None, :]
        return ids.reshape(-1, 3).to(device=self.device, dtype=self.dtype)

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        text = torch.stack([row.text.tokens for row in rows])
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([row.guidance for row in rows], dtype=torch.float32, device=self.device)
        return self.transformer(
            hidden_states=torch.stack([row.latents for row in rows]),
            timestep=self._timesteps(rows),
            guidance=guidance,
            pooled_projections=torch.stack([row.text.pooled for row in rows]),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=self._image_ids(height, width),
            return_dict=False,
        )[0]

    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]:
        vae = self.pipeline.vae
        z = unpack_latents(torch.stack(list(latents)), *self.latent_size(height, width))
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        return self._postprocess(vae.decode(z, return_dict=False)[0])


class QwenImageBackend(_Backend):
    family = "qwen-image"
    max_sequence_length_limit = 1024

    def describe(self, name: str) -> FamilyInfo:
        return self._info(name, variant="qwen-image", default_steps=50, default_true_cfg_scale=4.0,
                          embedded_guidance=False, default_guidance_scale=None, default_negative_prompt=" ")

    def encode(self, prompt: str) -> TextEmbedding:
        tokens, mask = self.pipeline.encode_prompt(
            prompt=prompt, device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length,
        )
        if mask is not None:  # only padding is masked, and one prompt alone is never padded
            tokens = tokens[:, : int(mask[0].sum())]
        return TextEmbedding(tokens[0], None)

    def forward(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        lengths = [row.text.tokens.shape[0] for row in rows]
        text = rows[0].text.tokens.new_zeros(len(rows), max(lengths), rows[0].text.tokens.shape[1])
        for i, row in enumerate(rows):
            text[i, : lengths[i]] = row.text.tokens
        latent_h, latent_w = self.latent_size(height, width)
        return self.transformer(
            hidden_states=torch.stack([row.latents for row in rows]),
            encoder_hidden_states=text,
            timestep=self._timesteps(rows),
            img_shapes=[[(1, latent_h // 2, latent_w // 2)]] * len(rows),
            attention_kwargs={"text_lengths": lengths},
            return_dict=False,
        )[0]

    def guide(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """True CFG, then rescaled per token to the conditional prediction's norm (as QwenImagePipeline does)."""
        combined = super().guide(cond, uncond, scale)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, latents: Sequence[Tensor], height: int, width: int) -> list[Image.Image]:
        vae = self.pipeline.vae
        z = unpack_latents(torch.stack(list(latents)), *self.latent_size(height, width)).unsqueeze(2).to(vae.dtype)
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        return self._postprocess(vae.decode(z / inverse_std + mean, return_dict=False)[0][:, :, 0])


BACKENDS: dict[FamilyName, type[_Backend]] = {"flux": FluxBackend, "qwen-image": QwenImageBackend}
PROCESSORS = {"flux": OmniFluxAttnProcessor, "qwen-image": OmniQwenImageAttnProcessor}


def _default_max_sequence_length(family: FamilyName, transformer_config: Mapping[str, Any]) -> int:
    if family == "flux":
        return 512 if transformer_config.get("guidance_embeds") else 256  # dev reads 512 T5 tokens, schnell 256
    return 512


def build_family_pipeline(
    family: FamilyName,
    components: Mapping[str, Any],
    *,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int | None = None,
    offload: Any = None,
    fp8: Any = None,
) -> FamilyPipeline:
    """A ``FamilyPipeline`` over already-loaded diffusers/transformers components (the diffusers pipeline's
    constructor arguments). omni's attention processors are installed on the transformer."""
    spec = next(s for s in FAMILIES.values() if s.family == family)
    pipeline = library_class("diffusers", spec.pipeline_class)(**components)
    backend_cls = BACKENDS[family]
    length = max_sequence_length or _default_max_sequence_length(family, pipeline.transformer.config)
    if not 1 <= length <= backend_cls.max_sequence_length_limit:
        raise ValueError(f"max_sequence_length must be in [1, {backend_cls.max_sequence_length_limit}], got {length}")
    pipeline.transformer.set_attn_processor(PROCESSORS[family]())
    backend = backend_cls(pipeline, device=device, dtype=dtype, max_sequence_length=length)
    return FamilyPipeline(backend, name=name, device=device, dtype=dtype, offload=offload, fp8=fp8)


@dataclass
class PreflightedCheckpoint:
    """A checkpoint whose metadata passed every check: its family, its model components (config and weight files
    checked against a meta-device model), and its tokenizers and scheduler (host objects, already built)."""

    spec: FamilySpec
    models: dict[str, PreflightedModel]
    host_components: dict[str, Any]


def preflight_family_checkpoint(directory: Path) -> PreflightedCheckpoint:
    """Check a diffusers checkpoint without reading any tensor data or touching a device.

    Raises ``CheckpointError`` (one line: the file and the problem) for a directory without ``model_index.json``,
    an unknown ``_class_name`` or component class, a missing/truncated/corrupt shard, a config that disagrees with
    its weights, or components that do not fit each other. Reads JSON, safetensors headers and tokenizer files.
    """
    index = read_pipeline_index(directory)
    spec = FAMILIES.get(index.class_name)
    if spec is None:
        raise CheckpointError(index.path, f"unknown _class_name {index.class_name!r}; supported: "
                                          f"{', '.join(sorted(FAMILIES))}")
    entries = _check_components(index, spec)
    models: dict[str, PreflightedModel] = {}
    host_components: dict[str, Any] = {}
    for slot_name, slot in spec.slots.items():
        entry = entries[slot_name]
        if slot.kind == "model":
            cls = library_class(slot.library, entry.class_name)
            preflight = _preflight_diffusers_model if slot.library == "diffusers" else _preflight_transformers_model
            models[slot_name] = preflight(entry, cls)
        elif slot.kind == "tokenizer":
            host_components[slot_name] = _load_tokenizer(entry)
        else:
            host_components[slot_name] = _load_scheduler(entry)
    _check_family_configs(spec, models)
    return PreflightedCheckpoint(spec, models, host_components)


def load_family_pipeline(
    directory: Path,
    *,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: Literal["fp8"] | None = None,
    fp8_cache_dir: str | Path | None = None,
    layerwise_offload: bool = False,
    offload_resident_blocks: int = 0,
    max_sequence_length: int | None = None,
) -> FamilyPipeline:
    """Preflight every component (raising ``CheckpointError`` before touching ``device``), then load.

    ``quantization="fp8"`` swaps the transformer's linears for FP8 linears (the family's ``fp8_ignore`` stays
    high precision): from ``fp8_cache_dir`` when it holds a current artifact (a warm start reads only the cache,
    never the bf16 shards; a miss quantizes and publishes it), else online. ``layerwise_offload`` keeps the
    transformer's blocks in host memory and streams them through two device slots (``pipe.offload``).
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    if fp8_cache_dir is not None and quantization != "fp8":
        raise ValueError("fp8_cache_dir needs quantization='fp8'")
    checked = preflight_family_checkpoint(directory)
    spec, models, host_components = checked.spec, checked.models, checked.host_components

    loaded: dict[str, Any] = {}
    try:
        transformer_device = torch.device("cpu") if layerwise_offload else device
        fp8 = None
        for slot_name, preflighted in models.items():
            if slot_name == "transformer":
                continue
            load = _load_diffusers_model if preflighted.entry.library == "diffusers" else _load_transformers_model
            loaded[slot_name] = load(preflighted, device=device, dtype=dtype)
        if quantization == "fp8" and fp8_cache_dir is not None:
            loaded["transformer"], fp8 = _load_fp8_transformer(
                models["transformer"], spec.family, device=transformer_device, dtype=dtype, cache_dir=Path(fp8_cache_dir))
        else:
            loaded["transformer"] = _load_diffusers_model(models["transformer"], device=transformer_device, dtype=dtype)
            if quantization == "fp8":
                from omni_models.integrations import quantize_family_fp8

                fp8 = quantize_family_fp8(spec.family, loaded["transformer"])
        offload = None
        if layerwise_offload:
            from dlo_offload import enable_layerwise_offload

            offload = enable_layerwise_offload(loaded["transformer"],
                                               family_offload_plan(spec.family, offload_resident_blocks),
                                               device=device, use_allgather=False)
        return build_family_pipeline(spec.family, {**host_components, **loaded}, name=name, device=device,
                                     dtype=dtype, max_sequence_length=max_sequence_length, offload=offload, fp8=fp8)
    except BaseException:
        loaded.clear()  # drop every component loaded so far, so a failed load leaves no device memory behind
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise
