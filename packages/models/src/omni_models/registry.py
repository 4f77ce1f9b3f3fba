"""One registry of model kinds, and the one ``inspect`` and ``load`` every kind goes through.

A model name resolves to a directory (``omni_models.hub``: a shipped name, a local directory, a repo id in the
local Hugging Face cache); the directory's kind is the first ``ModelKind`` it matches, read from metadata only
(a diffusers checkpoint's ``model_index.json`` class name, an omni model's marker file). Each kind's work lives in
one backend module (``omni_models.backends.<kind>``, imported on first use) with two functions:

- ``inspect(directory, name) -> ModelSpec``: the model's ``ModelInfo`` and capabilities from metadata alone
  (configs, safetensors headers), raising ``CheckpointError`` naming the file before anything is loaded;
- ``load(directory, name, options) -> StepwisePipeline`` (``omni_models.contract``).

Adding a model kind is one ``KINDS`` entry and one backend module; nothing else branches on kind.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from omni_models.errors import CheckpointError
from omni_models.hub import DIFFUSERS_INDEX_NAME, resolve_model_dir

if TYPE_CHECKING:
    import torch

    from omni_models.contract import StepwisePipeline
    from omni_models.lora import LoRAOptions, LoRAWeights
    from omni_models.spec import ModelSpec

AttentionBackend = Literal["paged", "dense"]
AttentionDtype = Literal["auto", "fp8"]  # the families' joint attention: the model's dtype, or FP8
ATTENTION_DTYPES = ("auto", "fp8")


def check_attention_dtype(attention_dtype: str) -> None:
    if attention_dtype not in ATTENTION_DTYPES:
        raise ValueError(f"attention_dtype must be one of {list(ATTENTION_DTYPES)}, got {attention_dtype!r}")


@dataclass(frozen=True)
class ModelKind:
    """One kind of model directory: a diffusers family is told by ``model_index.json``'s ``_class_name``
    (``pipeline_class``), an omni model by a ``marker`` file beside its ``config.json``."""

    name: str
    backend: str  # the module holding inspect() and load()
    pipeline_class: str | None = None
    marker: str | None = None

    def matches(self, directory: Path, pipeline_class: str | None) -> bool:
        if self.pipeline_class is not None:
            return pipeline_class == self.pipeline_class
        return pipeline_class is None and self.marker is not None and (directory / self.marker).is_file()

    def module(self) -> Any:
        return importlib.import_module(self.backend)


# First match wins: a music model directory also holds a config.json, so it comes before the DiT.
KINDS: tuple[ModelKind, ...] = (
    ModelKind("omni-music", "omni_models.backends.music", marker="ar.safetensors"),
    ModelKind("omni-dit", "omni_models.backends.dit", marker="config.json"),
    ModelKind("flux", "omni_models.backends.flux", pipeline_class="FluxPipeline"),
    ModelKind("flux-kontext", "omni_models.backends.flux_kontext", pipeline_class="FluxKontextPipeline"),
    ModelKind("qwen-image", "omni_models.backends.qwen_image", pipeline_class="QwenImagePipeline"),
    ModelKind(
        "qwen-image-edit-plus", "omni_models.backends.qwen_image_edit", pipeline_class="QwenImageEditPlusPipeline"
    ),
    ModelKind("qwen-image-edit", "omni_models.backends.qwen_image_edit", pipeline_class="QwenImageEditPipeline"),
    ModelKind("wan", "omni_models.backends.wan", pipeline_class="WanPipeline"),
)


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model; ``omni_models.load``'s arguments after their checks. Each backend refuses, naming the
    option, what its kind cannot do (``capabilities`` in its ``ModelSpec`` says so before loading)."""

    device: torch.device
    dtype: torch.dtype
    quantization: Literal["fp8"] | None = None
    fp8_cache_dir: Path | None = None
    layerwise_offload: bool = False
    offload_resident_blocks: int = 0
    offload_allgather: bool = False  # shard the streamed blocks over ``offload_group`` (several ranks)
    offload_group: Any = None  # a torch.distributed ProcessGroup: omni_models.parallel.ParallelState.offload_group
    attention_backend: AttentionBackend | None = None  # omni-dit only: "paged" (default) or "dense"
    cuda_graphs: bool = False  # omni-dit only
    max_sequence_length: int | None = None  # diffusers families: prompt tokens the text encoder reads
    # Compiled serving (omni_models.compilation): families compile their repeated blocks and VAE decoder, the DiT
    # captures CUDA graphs; compile_backend "eager"/"aot_eager" trace without generating code (tests).
    compile: bool = False
    compile_backend: str = "inductor"
    compile_cache_dir: Path | None = None  # inductor's FX graph / AOTAutograd caches, reused by a restart
    prompt_embed_cache_size: int = 0  # diffusers families: prompts whose text embeddings stay cached (LRU)
    # diffusers families: the most image tokens one transformer forward or VAE decode batches (0: no limit)
    max_batched_image_tokens: int = 0
    lora: LoRAOptions | None = None  # diffusers families: serve LoRA adapters per request (``pipeline.lora``)
    attention_dtype: AttentionDtype = "auto"  # diffusers families: "fp8" attends in FP8 (omni_models.attention)

    def __post_init__(self) -> None:
        check_load_options(
            quantization=self.quantization,
            fp8_cache_dir=self.fp8_cache_dir,
            layerwise_offload=self.layerwise_offload,
            offload_resident_blocks=self.offload_resident_blocks,
            offload_allgather=self.offload_allgather,
        )
        if self.offload_allgather and self.offload_group is None:
            raise ValueError(
                "offload_allgather shards blocks over a process group; pass offload_group (the "
                "ParallelState's offload_group)"
            )
        if self.attention_backend not in (None, "paged", "dense"):
            raise ValueError(f"attention_backend must be 'paged' or 'dense', got {self.attention_backend!r}")
        check_compile_options(
            compile=self.compile,
            compile_backend=self.compile_backend,
            compile_cache_dir=self.compile_cache_dir,
            layerwise_offload=self.layerwise_offload,
        )
        if self.prompt_embed_cache_size < 0:
            raise ValueError(f"prompt_embed_cache_size must be >= 0, got {self.prompt_embed_cache_size}")
        if self.max_batched_image_tokens < 0:
            raise ValueError(
                f"max_batched_image_tokens must be >= 0 (0: no limit), got {self.max_batched_image_tokens}"
            )
        check_attention_dtype(self.attention_dtype)


def check_load_options(
    *,
    quantization: str | None = None,
    fp8_cache_dir: object = None,
    layerwise_offload: bool = False,
    offload_resident_blocks: int = 0,
    offload_allgather: bool = False,
) -> None:
    """The rules of ``load``'s FP8 and offload options, checkable before any model exists (a server checks its
    flags with it at start); ``ValueError`` naming the options and what to change."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    if fp8_cache_dir is not None and quantization != "fp8":
        raise ValueError("fp8_cache_dir caches FP8 weights, so it needs quantization='fp8'")
    if offload_resident_blocks < 0:
        raise ValueError(f"offload_resident_blocks must be >= 0, got {offload_resident_blocks}")
    if (offload_resident_blocks or offload_allgather) and not layerwise_offload:
        raise ValueError(
            "offload_resident_blocks and offload_allgather apply to layerwise offload; turn on layerwise_offload"
        )


def check_compile_options(
    *,
    compile: bool = False,
    compile_backend: str = "inductor",
    compile_cache_dir: object = None,
    layerwise_offload: bool = False,
) -> None:
    """The rules of ``load``'s compile options (a server checks its flags with it at start)."""
    from omni_models.compilation import COMPILE_BACKENDS

    if compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile_backend must be one of {list(COMPILE_BACKENDS)}, got {compile_backend!r}")
    if compile and layerwise_offload:
        raise ValueError(
            "compile cannot be combined with layerwise_offload (its hooks move weights between compiled blocks)"
        )
    if compile_cache_dir is not None and not compile:
        raise ValueError("compile_cache_dir keeps compiled graphs, so it needs compile=True")


def kind_of(directory: Path) -> ModelKind:
    """The registry entry of a model directory, from its metadata; ``CheckpointError`` when none matches."""
    index = directory / DIFFUSERS_INDEX_NAME
    pipeline_class = None
    if index.is_file():
        try:
            pipeline_class = json.loads(index.read_text()).get("_class_name")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(index, f"unreadable pipeline index: {exc}") from None
        if not isinstance(pipeline_class, str):
            raise CheckpointError(index, "has no string _class_name naming the pipeline")
    for kind in KINDS:
        if kind.matches(directory, pipeline_class):
            return kind
    if pipeline_class is not None:
        supported = ", ".join(sorted(k.pipeline_class for k in KINDS if k.pipeline_class))
        raise CheckpointError(index, f"unknown _class_name {pipeline_class!r}; supported: {supported}")
    raise CheckpointError(directory, "not a model directory omni knows")


def inspect(name_or_path: str, *, allow_download: bool = False) -> ModelSpec:
    """What the model is and accepts, from its metadata alone (no tensor data read, no device touched).

    Raises ``InvalidRequestError`` (param ``model``) for a name that resolves to nothing and ``CheckpointError``
    (one line: the file and the problem) for a bad checkpoint.
    """
    directory = resolve_model_dir(name_or_path, allow_download=allow_download)
    return kind_of(directory).module().inspect(directory, name_or_path)


def load(
    name_or_path: str = "omni-shapes-tiny",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    quantization: Literal["fp8"] | None = None,
    fp8_cache_dir: str | Path | None = None,
    layerwise_offload: bool = False,
    offload_resident_blocks: int = 0,
    offload_allgather: bool = False,
    offload_group: Any = None,
    attention_backend: AttentionBackend | None = None,
    cuda_graphs: bool = False,
    max_sequence_length: int | None = None,
    compile: bool = False,
    compile_backend: str = "inductor",
    compile_cache_dir: str | Path | None = None,
    prompt_embed_cache_size: int = 0,
    max_batched_image_tokens: int = 0,
    lora: LoRAOptions | None = None,
    attention_dtype: AttentionDtype = "auto",
    allow_download: bool = False,
) -> StepwisePipeline:
    """Load any model omni knows (shipped name, local directory, or a Hugging Face repo id from the local cache
    only, unless ``allow_download``) as a pipeline implementing ``omni_models.contract.StepwisePipeline``.

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA. ``quantization="fp8"`` swaps eligible linears for FP8
    linears, read from ``fp8_cache_dir`` when it holds a current artifact (a miss quantizes and publishes it);
    ``layerwise_offload`` keeps the repeated blocks in host memory and streams them to the device
    (``offload_resident_blocks`` leading blocks stay; ``offload_allgather`` shards them over the ranks of
    ``offload_group``, a ``ParallelState.offload_group``). ``attention_backend`` and ``cuda_graphs`` apply to the
    causal-prefix DiT, ``max_sequence_length`` to the diffusers families. ``compile`` compiles the model for serving
    (``omni_models.compilation``: the families' repeated blocks and VAE decoder with ``torch.compile``, the DiT's
    CUDA graphs; ``ModelSpec.capabilities.compile`` says whether a kind can), keeping inductor's caches in
    ``compile_cache_dir`` when given. ``prompt_embed_cache_size`` keeps that many prompts' text embeddings (the
    families; LRU, ``omni_models.prompt_cache``). ``max_batched_image_tokens`` caps the image tokens one transformer
    forward or VAE decode of a family batches (``FamilyPipeline.forward_parts``; 0: no limit). ``lora``
    (``omni_models.lora.LoRAOptions``) gives a diffusers family's pipeline ``pipeline.lora``, where adapters are
    registered and then named per request.
    ``attention_dtype="fp8"`` runs the diffusers families' attention in FP8 (``omni_models.attention``; opt-in,
    ``ModelSpec.capabilities.fp8_attention`` says which kinds can). A bad checkpoint
    raises ``CheckpointError`` before anything is placed on ``device``."""
    import torch

    directory = resolve_model_dir(name_or_path, allow_download=allow_download)
    device = torch.device(device)
    options = LoadOptions(
        device=device,
        dtype=dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
        quantization=quantization,
        fp8_cache_dir=None if fp8_cache_dir is None else Path(fp8_cache_dir),
        layerwise_offload=layerwise_offload,
        offload_resident_blocks=offload_resident_blocks,
        offload_allgather=offload_allgather,
        offload_group=offload_group,
        attention_backend=attention_backend,
        cuda_graphs=cuda_graphs,
        max_sequence_length=max_sequence_length,
        compile=compile,
        compile_backend=compile_backend,
        compile_cache_dir=None if compile_cache_dir is None else Path(compile_cache_dir),
        prompt_embed_cache_size=prompt_embed_cache_size,
        max_batched_image_tokens=max_batched_image_tokens,
        lora=lora,
        attention_dtype=attention_dtype,
    )
    if options.compile_cache_dir is not None:
        from omni_models.compilation import compile_cache_scope, use_compile_cache

        use_compile_cache(options.compile_cache_dir / compile_cache_scope(directory, _cache_key(options)))
    return kind_of(directory).module().load(directory, name_or_path, options)


def _cache_key(options: LoadOptions) -> list[tuple[str, Any]]:
    """The load options that shape what gets compiled (the compile cache keeps a directory per model and these)."""
    skip = {"compile_cache_dir", "fp8_cache_dir", "offload_group", "prompt_embed_cache_size"}
    return [(f.name, getattr(options, f.name)) for f in fields(options) if f.name not in skip]


def import_for_load(name_or_path: str) -> None:
    """Import what ``load`` of this model will import: torch, its kind's backend and, for a diffusers family, the
    checkpoint's pipeline class (with the transformers classes it pulls in). It reads only the model's metadata
    (which kind it is) and loads nothing, so a server can run it while its checks of the model run elsewhere;
    a problem with the model raises here as it would in ``inspect``."""
    import torch  # noqa: F401  (most of the time: the backends import it lazily)

    kind = kind_of(resolve_model_dir(name_or_path))
    kind.module()
    if kind.pipeline_class is not None:
        from omni_models.diffusers_adapter import library_class

        library_class("diffusers", kind.pipeline_class)


def inspect_lora(name_or_path: str, lora_path: str | Path, *, max_rank: int) -> LoRAWeights:
    """Read a LoRA adapter file and check it against a model's metadata without loading the model (what a server
    checks at start). Raises ``omni_models.lora.LoRAError`` (one line: the file and the problem), also for a model
    kind that takes no adapters."""
    from omni_models.lora import LoRAError

    directory = resolve_model_dir(name_or_path)
    kind = kind_of(directory)
    module = kind.module()
    if not hasattr(module, "inspect_lora"):
        raise LoRAError(lora_path, f"{name_or_path} is an {kind.name} model, which takes no LoRA adapters")
    return module.inspect_lora(directory, Path(lora_path), max_rank=max_rank)


__all__ = [
    "KINDS",
    "LoadOptions",
    "ModelKind",
    "ATTENTION_DTYPES",
    "AttentionDtype",
    "check_attention_dtype",
    "check_compile_options",
    "check_load_options",
    "import_for_load",
    "inspect",
    "inspect_lora",
    "kind_of",
    "load",
]
