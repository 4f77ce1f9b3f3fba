"""Server configuration, declared once: one typed struct whose fields carry their constraints, help and CLI group.

Precedence (highest first): explicit CLI flags > YAML file > the defaults below. ``omni_server.cli`` generates
every flag from these fields (vLLM's ``EngineArgs.add_cli_args`` pattern): the flag is the field name with dashes,
its type, choices, help and group come from the field's annotation, so a setting is written in one place.

Invariant: a ``ServerConfig`` that exists is valid on its own. Every field's constraint (``msgspec.Meta``: bounds,
patterns, choices) is checked at construction, and so are the rules that belong to the server (what a flag needs
beside it). Rules that belong to a library (an offload or FP8 combination, what a model can do) are checked with
that library by ``omni_server.startup.check_startup`` before anything loads. Every failure is a ``ConfigError``
whose message names the flag and says what to change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    from omni_models.step_cache import StepCacheConfig

DEFAULT_MODEL = "omni-shapes-tiny"
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["debug", "info", "warning", "error"]
BOTH = ("serve", "generate")
SERVE = ("serve",)


class ConfigError(ValueError):
    """An invalid setting or combination of settings; the message says what to change."""


def setting(
    help: str,
    *,
    group: str,
    commands: tuple[str, ...] = SERVE,
    parse: str | None = None,
    metavar: str | None = None,
    expected: str | None = None,
    **constraints: Any,
) -> Meta:
    """A field's declaration: its help text, its ``--help`` group, the commands that take it, how the CLI parses
    it (``parse``: ``human_int`` for ``512M``-style sizes, ``list`` for JSON or comma lists), its constraints, and
    ``expected``: what a message says the value must be when a ``pattern`` does not match."""
    extra: dict[str, Any] = {"group": group, "commands": commands}
    if expected is not None:
        extra["expected"] = expected
    if parse is not None:
        extra["parse"] = parse
    if metavar is not None:
        extra["metavar"] = metavar
    return Meta(description=help, extra=extra, **constraints)


class LoRAModule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One adapter served beside the base model (vLLM's ``--lora-modules`` entry): clients select it with
    ``model: "<name>"``; ``path`` is a LoRA ``.safetensors`` file or a directory holding one; ``base_model_name``,
    when given, must be the served model's name (it is the adapter's ``parent`` in ``/v1/models``)."""

    name: Annotated[str, Meta(min_length=1, pattern=r"^[^\s=]+$")]
    path: Annotated[str, Meta(min_length=1)]
    base_model_name: str | None = None


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the API process and the engine process need to start (a msgspec struct, so it travels to the
    engine process and the worker ranks as bytes)."""

    # ModelConfig
    model: Annotated[
        str,
        setting(
            "model name or directory (default: the shipped omni-shapes-tiny)",
            group="ModelConfig",
            commands=BOTH,
            min_length=1,
        ),
    ] = DEFAULT_MODEL
    device: Annotated[
        str,
        setting(
            "auto, cpu, cuda or cuda:N",
            group="ModelConfig",
            commands=BOTH,
            pattern=r"^(auto|cpu|cuda(:\d+)?)$",
            expected="'auto', 'cpu', 'cuda' or 'cuda:N'",
        ),
    ] = "auto"
    dtype: Annotated[
        Dtype,
        setting("weight and activation dtype; auto: bf16 on CUDA, fp32 on CPU", group="ModelConfig", commands=BOTH),
    ] = "auto"
    # OffloadConfig (dlo_offload)
    enable_layerwise_offload: Annotated[
        bool,
        setting(
            "keep the repeated blocks in host memory and stream each to the device just in time",
            group="OffloadConfig",
            commands=BOTH,
        ),
    ] = False
    offload_resident_blocks: Annotated[
        int,
        setting(
            "leading blocks that stay on the device under layerwise offload", group="OffloadConfig", commands=BOTH, ge=0
        ),
    ] = 0
    offload_allgather: Annotated[
        bool,
        setting(
            "shard the streamed blocks across the sequence-parallel ranks' host memory and AllGather each block "
            "just in time (needs --enable-layerwise-offload and --sequence-parallel-size >= 2)",
            group="OffloadConfig",
            commands=BOTH,
        ),
    ] = False
    # QuantizationConfig (fp8_cache)
    quantization: Annotated[
        Literal["fp8"] | None, setting("quantize eligible linears to FP8", group="QuantizationConfig", commands=BOTH)
    ] = None
    fp8_cache_dir: Annotated[
        str | None,
        setting(
            "reuse FP8 weights quantized by an earlier start (needs --quantization fp8)",
            group="QuantizationConfig",
            commands=BOTH,
            metavar="DIR",
        ),
    ] = None
    attention_dtype: Annotated[
        Literal["auto", "fp8"],
        setting(
            "the diffusers families (FLUX.1, Qwen-Image, Wan): fp8 runs their attention in FP8 (e4m3 queries, keys "
            "and values with per-head scales; omni's FP8 attention kernel on CUDA, compute capability 9.0+); auto: "
            "the model's dtype",
            group="QuantizationConfig",
            commands=BOTH,
        ),
    ] = "auto"
    # CompilationConfig: compiled serving (omni_models.compilation)
    enforce_eager: Annotated[
        bool,
        setting(
            "run the model eagerly: no torch.compile, no CUDA graphs (default on CUDA: compiled, the families' "
            "repeated blocks and VAE decoder with torch.compile, the DiT's steps as CUDA graphs, every served size "
            "warmed up before /health is ready; on CPU, and under layerwise offload, the model always runs eager)",
            group="CompilationConfig",
            commands=BOTH,
        ),
    ] = False
    compile_cache_dir: Annotated[
        str | None,
        setting(
            "keep inductor's FX graph and AOTAutograd caches here (a subdirectory per model and load options), so "
            "a restart reuses the compiled graphs (not with --enforce-eager)",
            group="CompilationConfig",
            commands=BOTH,
            metavar="DIR",
        ),
    ] = None
    prompt_embed_cache_size: Annotated[
        int,
        setting(
            "diffusers families: prompts whose text embeddings stay cached on the device (LRU; a repeated prompt "
            "skips the text encoders); 0: none",
            group="CompilationConfig",
            commands=BOTH,
            ge=0,
        ),
    ] = 32
    # LoRAConfig (omni_models.lora): unmerged adapters, a different one per request in one batched forward
    enable_lora: Annotated[
        bool,
        setting(
            "serve LoRA adapters (diffusers families): a request selects one with model=<adapter name>",
            group="LoRAConfig",
        ),
    ] = False
    lora_modules: Annotated[
        list[LoRAModule],
        setting(
            "adapters to serve, each name=path or a JSON object with name, path and base_model_name; path: a LoRA "
            ".safetensors file or a directory holding one (diffusers/PEFT or kohya layout; needs --enable-lora)",
            group="LoRAConfig",
            parse="lora_modules",
            metavar="NAME=PATH",
        ),
    ] = []
    max_loras: Annotated[
        int,
        setting(
            "adapters on the device at once (fixed slots: a forward mixing more is split into several)",
            group="LoRAConfig",
            ge=1,
            le=64,
        ),
    ] = 4
    max_cpu_loras: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        setting(
            "adapters kept in host memory (others are read from disk again when used; default: --max-loras)",
            group="LoRAConfig",
        ),
    ] = None
    max_lora_rank: Annotated[
        int,
        setting(
            "largest adapter rank; every slot is this rank (padded), so mixing adapters never recompiles",
            group="LoRAConfig",
            commands=BOTH,
            ge=1,
            le=512,
        ),
    ] = 16
    lora_target_modules: Annotated[
        list[str] | None,
        setting(
            "the linears LoRA applies to, as PEFT's target_modules: module names or name suffixes (to_q "
            "attn.to_out.0 ...) or all-linear; an adapter with layers elsewhere is refused (default: the linears the "
            "--lora-modules adapters hold, when adapters cannot be loaded at run time; else all-linear)",
            group="LoRAConfig",
            parse="names",
            metavar="NAME",
        ),
    ] = None
    allow_runtime_lora_updating: Annotated[
        bool,
        setting(
            "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING as a flag)",
            group="LoRAConfig",
        ),
    ] = False
    # ParallelConfig: world size = cfg_parallel_size x sequence_parallel_size, one process per GPU
    cfg_parallel_size: Annotated[
        Literal[1, 2],
        setting("run the cond and uncond rows of guided requests on two ranks", group="ParallelConfig", commands=BOTH),
    ] = 1
    sequence_parallel_size: Annotated[
        int,
        setting(
            "Ulysses sequence parallelism: split each forward's tokens over N ranks (all-to-all over heads; N must "
            "divide the model's heads)",
            group="ParallelConfig",
            commands=BOTH,
            metavar="N",
            ge=1,
        ),
    ] = 1
    # RuntimeConfig
    seed: Annotated[
        int,
        setting(
            "serve: the seed of the stream requests without a seed draw from; generate: the request's seed when "
            "--image-seed is not given",
            group="RuntimeConfig",
            commands=BOTH,
            ge=0,
        ),
    ] = 0
    log_level: Annotated[LogLevel, setting("how much the server logs", group="RuntimeConfig", commands=BOTH)] = "info"
    # CacheConfig: the paged KV pool
    block_size: Annotated[int, setting("tokens per KV block (a power of two)", group="CacheConfig", ge=1)] = 16
    kv_cache_memory_bytes: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        setting(
            "explicit KV pool budget, e.g. 512M or 2G; 0 or unset sizes it from --gpu-memory-utilization after "
            "profiling",
            group="CacheConfig",
            parse="human_int",
            metavar="BYTES",
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float, setting("fraction of device memory the engine may use in total", group="CacheConfig", gt=0.0, le=1.0)
    ] = 0.9
    max_model_len: Annotated[
        Annotated[int, Meta(ge=-1)] | None,
        setting(
            "longest CFG row (prompt + image tokens) admitted; -1 or unset: the model's longest row (longest prompt + "
            "largest image)",
            group="CacheConfig",
            parse="human_int",
            metavar="TOKENS",
        ),
    ] = None
    # SchedulerConfig
    max_num_seqs: Annotated[
        int, setting("most requests running at once (their rows share each forward)", group="SchedulerConfig", ge=1)
    ] = 16
    max_rows_per_step: Annotated[
        int,
        setting(
            "CFG rows per forward; jobs with the fewest steps left go first, so a short request is not held behind "
            "long ones; 0: every running row in every forward",
            group="SchedulerConfig",
            ge=0,
        ),
    ] = 8
    max_batched_image_tokens: Annotated[
        int,
        setting(
            "diffusers families: the most image tokens (output and reference latents) one transformer forward or "
            "VAE decode batches; further rows of the step run in the next forward, a request's CFG rows together "
            "(from 1024² on one row fills an H200, and a second row count would cost compiled graphs of its "
            "own); 0: no limit",
            group="SchedulerConfig",
            commands=BOTH,
            ge=0,
            parse="human_int",
            metavar="TOKENS",
        ),
    ] = 4096
    batch_invariant: Annotated[
        bool,
        setting(
            "run each image's rows in a forward of their own, so an image of an n-image or concurrent request is "
            "bit-equal to the same image requested alone (slower: no batching across images)",
            group="SchedulerConfig",
        ),
    ] = False
    # StepCacheConfig: the step cache of requests that name none (omni_models.step_cache)
    step_cache: Annotated[
        Literal["off", "safe", "fast"],
        setting(
            "the step cache of requests without a `cache` field: a preset (each request may name its own)",
            group="StepCacheConfig",
            commands=BOTH,
        ),
    ] = "off"
    step_cache_config: Annotated[
        str | None,
        setting(
            'knobs over --step-cache as a JSON object, e.g. \'{"threshold": 0.1, "taylor_order": 1}\' (alone: over '
            "the residual test's defaults); the knobs are those of a request's `cache` object",
            group="StepCacheConfig",
            commands=BOTH,
            metavar="JSON",
        ),
    ] = None
    step_cache_memory_bytes: Annotated[
        int,
        setting(
            "most memory the step caches of admitted requests may hold together, e.g. 4G; a request waits until "
            "its cache fits, and one that never fits fails at once",
            group="StepCacheConfig",
            parse="human_int",
            metavar="BYTES",
            ge=1,
        ),
    ] = 4 * 2**30
    # Frontend
    served_model_name: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        setting("the name clients pass as `model` (default: the model argument)", group="Frontend"),
    ] = None
    host: Annotated[str, setting("the address to listen on", group="Frontend", min_length=1)] = "127.0.0.1"
    port: Annotated[int, setting("the port to listen on (0: any free port)", group="Frontend", ge=0, le=65535)] = 8000
    engine_start_timeout_s: Annotated[
        float, setting("give up if the engine is not ready by then", group="Frontend", metavar="SECONDS", gt=0.0)
    ] = 600.0
    warmup: Annotated[bool, setting("run one request through the engine before reporting ready", group="Frontend")] = (
        True
    )
    # Limits: everything a client controls is bounded, each answered in the OpenAI error shape
    max_request_body_bytes: Annotated[
        int, setting("larger bodies get 413, e.g. 1M", group="Limits", parse="human_int", metavar="BYTES", ge=1)
    ] = 2**20
    max_prompt_chars: Annotated[int, setting("longer prompts get 400 before tokenizing", group="Limits", ge=1)] = 2000
    max_input_image_bytes: Annotated[
        int,
        setting(
            "an edit's input image file larger than this gets 400 (the edits route's body may hold "
            "--max-request-body-bytes plus 4 of them)",
            group="Limits",
            commands=BOTH,
            parse="human_int",
            metavar="BYTES",
            ge=1,
        ),
    ] = 20 * 2**20
    max_input_image_pixels: Annotated[
        int,
        setting(
            "an edit's input image with more pixels (width x height, read from its header) gets 400",
            group="Limits",
            commands=BOTH,
            parse="human_int",
            metavar="PIXELS",
            ge=1,
        ),
    ] = 4096 * 4096
    max_error_message_chars: Annotated[int, setting("error messages are cut to this length", group="Limits", ge=1)] = (
        2000
    )
    max_header_bytes: Annotated[
        int,
        setting("request line + headers; larger gets 431", group="Limits", parse="human_int", metavar="BYTES", ge=1),
    ] = 16 * 2**10
    max_header_count: Annotated[int, setting("more headers get 431", group="Limits", ge=1)] = 100
    header_timeout_s: Annotated[
        float, setting("the request head must arrive within this, else 408", group="Limits", metavar="SECONDS", gt=0.0)
    ] = 10.0
    body_timeout_s: Annotated[
        float, setting("the body must arrive within this, else 408", group="Limits", metavar="SECONDS", gt=0.0)
    ] = 30.0
    max_queued_requests: Annotated[
        int, setting("requests accepted beyond --max-num-seqs; more get 429 with Retry-After", group="Limits", ge=0)
    ] = 32
    request_timeout_s: Annotated[
        float,
        setting(
            "a request still unfinished then is aborted with 504; 0: none", group="Limits", metavar="SECONDS", ge=0.0
        ),
    ] = 600.0
    shutdown_timeout_s: Annotated[
        float,
        setting(
            "on SIGTERM/SIGINT, in-flight requests may finish within this; the rest get 503",
            group="Limits",
            metavar="SECONDS",
            ge=0.0,
        ),
    ] = 30.0
    # VideoConfig: the videos API (omni_server.videos): jobs, their files on disk, the bounds of both
    video_dir: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        setting(
            "where finished videos (MP4 and metadata) are kept; they survive a restart until they expire "
            "(default: $XDG_CACHE_HOME/omni-server/videos, else ~/.cache/omni-server/videos)",
            group="VideoConfig",
            metavar="DIR",
        ),
    ] = None
    max_video_jobs: Annotated[
        int,
        setting("video jobs queued or running at once; more get 429 with Retry-After", group="VideoConfig", ge=1),
    ] = 4
    max_videos_kept: Annotated[
        int,
        setting("finished videos (completed or failed) kept; the oldest go first", group="VideoConfig", ge=1),
    ] = 100
    max_video_storage_bytes: Annotated[
        int,
        setting(
            "MP4 bytes kept in --video-dir, e.g. 4G; the oldest videos go first",
            group="VideoConfig",
            parse="human_int",
            metavar="BYTES",
            ge=1,
        ),
    ] = 4 * 2**30
    video_ttl_s: Annotated[
        float,
        setting(
            "a finished video is deleted this long after it finished (its expires_at)",
            group="VideoConfig",
            metavar="SECONDS",
            gt=0.0,
        ),
    ] = 24 * 3600.0
    max_video_frames: Annotated[
        int,
        setting("frames per video job; more get 400 (the model has its own maximum too)", group="VideoConfig", ge=1),
    ] = 241
    max_video_pixels: Annotated[
        int,
        setting(
            "width x height x frames per video job, e.g. 128M; more get 400",
            group="VideoConfig",
            parse="human_int",
            metavar="PIXELS",
            ge=1,
        ),
    ] = 2**27
    video_crf: Annotated[
        int,
        setting(
            "MP4 quality: libx264's constant rate factor (0 lossless, which browsers do not play; 18 visually "
            "lossless; 23 libx264's default; 51 worst)",
            group="VideoConfig",
            commands=BOTH,
            ge=0,
            le=51,
        ),
    ] = 18
    # Supervision of the engine process
    engine_restarts: Annotated[
        int, setting("restart a dead engine up to N times in a row, with backoff; 0: never", group="Supervision", ge=0)
    ] = 5
    engine_heartbeat_timeout_s: Annotated[
        float,
        setting("an engine silent this long is stalled: /health 503", group="Supervision", metavar="SECONDS", gt=0.0),
    ] = 0.5
    # Security: who may call the server
    api_key: Annotated[
        Annotated[str, Meta(pattern=r"\S")] | None,
        setting(
            "require 'Authorization: Bearer KEY' on /v1/* (401 otherwise)",
            group="Security",
            expected="a key that is not blank (drop --api-key to serve without one)",
        ),
    ] = None
    allowed_origins: Annotated[
        list[str],
        setting(
            "CORS origins, a JSON list or comma-separated (default: none, no CORS headers)",
            group="Security",
            parse="list",
            metavar="LIST",
        ),
    ] = []
    allowed_hosts: Annotated[
        list[str] | None,
        setting(
            "Host header values the server answers to, '*' for any (default: the loopback names when bound to a "
            "loopback address, else any)",
            group="Security",
            parse="list",
            metavar="LIST",
        ),
    ] = None

    def __post_init__(self) -> None:
        check_constraints(self)
        _check_server_rules(self)

    @property
    def model_name(self) -> str:
        """The name clients pass as ``model`` (defaults to the model argument)."""
        return self.served_model_name or self.model

    @property
    def max_form_body_bytes(self) -> int:
        """The body bound of a route that takes files (the edits route): the JSON bound plus the most input images
        of their largest size."""
        from omni_models.limits import MAX_INPUT_IMAGES

        return self.max_request_body_bytes + MAX_INPUT_IMAGES * self.max_input_image_bytes

    @property
    def world_size(self) -> int:
        """Ranks (one process per GPU) that serve each request: CFG-parallel x sequence-parallel."""
        return self.cfg_parallel_size * self.sequence_parallel_size

    def default_step_cache(self) -> StepCacheConfig:
        """The step cache of a request that names none (``--step-cache`` with ``--step-cache-config`` over it)."""
        return _step_cache_default(self)

    def resolved_video_dir(self) -> Path:
        """``--video-dir``, or the default under the user's cache directory."""
        if self.video_dir is not None:
            return Path(self.video_dir).expanduser()
        import os

        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(cache) / "omni-server" / "videos"

    def resolved_device(self) -> str:
        """``auto`` becomes ``cuda`` when a CUDA device is visible, else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


FIELD_NAMES: tuple[str, ...] = ServerConfig.__struct_fields__
FIELDS: dict[str, msgspec.inspect.Field] = {f.name: f for f in msgspec.inspect.type_info(ServerConfig).fields}


def flag(name: str) -> str:
    """The CLI flag of a field (``max_num_seqs`` -> ``--max-num-seqs``; the ``_s`` of seconds is dropped)."""
    return "--" + re.sub(r"_s$", "", name).replace("_", "-")


def declared(name: str) -> tuple[msgspec.inspect.Type, dict[str, Any], str]:
    """(the field's type without its metadata, its declaration's ``extra``, its help text)."""
    info = FIELDS[name].type
    extra: dict[str, Any] = {}
    help_text = ""
    while isinstance(info, msgspec.inspect.Metadata):
        extra = {**extra, **(info.extra or {})}
        help_text = (info.extra_json_schema or {}).get("description", help_text)
        info = info.type
    return info, extra, help_text


_BOUNDS = (
    ("ge", ">=", lambda v, b: v >= b),
    ("gt", ">", lambda v, b: v > b),
    ("le", "<=", lambda v, b: v <= b),
    ("lt", "<", lambda v, b: v < b),
)


def _constraint_problem(value: Any, info: msgspec.inspect.Type, expected: str | None = None) -> str | None:
    if isinstance(info, msgspec.inspect.UnionType):
        if value is None and any(isinstance(t, msgspec.inspect.NoneType) for t in info.types):
            return None
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        for attribute, sign, holds in _BOUNDS:
            bound = getattr(info, attribute)
            if bound is not None and not holds(value, bound):
                return f"must be {sign} {bound}"
    if isinstance(info, msgspec.inspect.StrType):
        if info.min_length is not None and len(value) < info.min_length:
            return "must not be empty"
        if info.pattern is not None and not re.search(info.pattern, value):
            return f"must be {expected}" if expected else f"must match {info.pattern}"
    if isinstance(info, msgspec.inspect.LiteralType) and value not in info.values:
        return f"must be one of {', '.join(map(repr, info.values))}"
    return None


def check_constraints(config: ServerConfig) -> None:
    """Every field's declared constraint, for configs built directly (``build_config`` decodes through msgspec,
    which checks them too); ``ConfigError`` naming the field and its flag."""
    for name in FIELD_NAMES:
        value = getattr(config, name)
        info, extra, _ = declared(name)
        problem = _constraint_problem(value, info, extra.get("expected"))
        if problem is not None:
            raise ConfigError(f"{name} {problem}; got {value!r} ({flag(name)})")


def _step_cache_default(config: ServerConfig) -> StepCacheConfig:
    import json

    from omni_models import InvalidRequestError
    from omni_models.step_cache import server_default

    knobs = None
    if config.step_cache_config is not None:
        try:
            knobs = json.loads(config.step_cache_config)
        except ValueError as exc:
            raise ConfigError(f"step_cache_config is not valid JSON: {exc} (--step-cache-config)") from None
        if not isinstance(knobs, dict):
            raise ConfigError(
                f"step_cache_config must be a JSON object of knobs, got {type(knobs).__name__} (--step-cache-config)"
            )
    try:
        return server_default(config.step_cache, knobs, where="--step-cache-config")
    except InvalidRequestError as exc:
        raise ConfigError(f"{exc} (--step-cache, --step-cache-config)") from None


def _check_server_rules(config: ServerConfig) -> None:
    """What a flag needs beside it, where the server owns the rule."""
    _step_cache_default(config)
    if config.block_size & (config.block_size - 1):
        raise ConfigError(f"block_size must be a positive power of two; got {config.block_size} (--block-size)")
    if config.max_model_len == 0:
        raise ConfigError("max_model_len must be positive or -1 (auto); got 0 (--max-model-len)")
    if config.compile_cache_dir is not None and config.enforce_eager:
        raise ConfigError(
            "--compile-cache-dir keeps compiled graphs, but --enforce-eager compiles nothing; drop one of them"
        )
    _check_lora_rules(config)
    if config.offload_allgather and config.sequence_parallel_size < 2:
        raise ConfigError(
            "--offload-allgather shards block weights over the sequence-parallel group (CFG ranks never share "
            "weights), so it needs --sequence-parallel-size >= 2"
        )


def _check_lora_rules(config: ServerConfig) -> None:
    if not config.enable_lora:
        given = [
            flag(name)
            for name, value in (
                ("lora_modules", config.lora_modules),
                ("max_cpu_loras", config.max_cpu_loras),
                ("lora_target_modules", config.lora_target_modules),
                ("allow_runtime_lora_updating", config.allow_runtime_lora_updating),
            )
            if value
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} configure LoRA serving; add --enable-lora")
        return
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ConfigError(
            f"--max-cpu-loras {config.max_cpu_loras} must be >= --max-loras {config.max_loras} (an adapter in a "
            "device slot keeps its host copy)"
        )
    if config.world_size > 1:
        raise ConfigError(
            "--enable-lora runs on one rank; drop --cfg-parallel-size/--sequence-parallel-size or --enable-lora"
        )
    if config.lora_target_modules is not None and not all(t.strip() for t in config.lora_target_modules):
        raise ConfigError("--lora-target-modules takes module names or suffixes (or all-linear); got an empty one")
    if config.lora_target_modules == []:
        raise ConfigError("--lora-target-modules needs at least one module name (or all-linear)")
    seen: set[str] = set()
    for module in config.lora_modules:
        if module.name in seen:
            raise ConfigError(f"--lora-modules names {module.name!r} twice; adapter names must be unique")
        if module.name == config.model_name:
            raise ConfigError(
                f"--lora-modules {module.name!r} is the served model's name; give the adapter a name of its own"
            )
        if module.base_model_name is not None and module.base_model_name != config.model_name:
            raise ConfigError(
                f"--lora-modules {module.name!r} has base_model_name {module.base_model_name!r}, but this server "
                f"serves {config.model_name!r}"
            )
        seen.add(module.name)


def parse_lora_modules(value: str | list[Any]) -> list[dict[str, Any]]:
    """``--lora-modules`` items: ``name=path`` or a JSON object (``{"name", "path", "base_model_name"}``), as
    ``vllm serve`` takes them; a YAML file may also give mappings."""
    items = value if isinstance(value, list) else [value]
    modules = []
    for item in items:
        if isinstance(item, Mapping):
            modules.append(dict(item))
            continue
        text = str(item).strip()
        if text.startswith("{"):
            import json

            try:
                parsed = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"expected name=path or a JSON object, got {text!r}: {exc}") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"expected a JSON object with name and path, got {text!r}")
            modules.append(parsed)
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"expected name=path (or a JSON object with name and path), got {text!r}")
        modules.append({"name": name, "path": path})
    return modules


_DECIMAL_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(value: str | int) -> int:
    """Parse ``"512M"`` (binary, 2**20) or ``"1.5g"`` (decimal, 10**9) like ``vllm serve`` does."""
    if isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kKmMgGtT]?)", text)
    if match is None:
        raise ConfigError(f"expected an integer like 4096, 512M (binary) or 1.5g (decimal), got {value!r}")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise ConfigError(f"expected a whole number, got {value!r}")
        return int(number)
    if suffix in _BINARY_SUFFIX:
        if "." in number:
            raise ConfigError(
                f"decimals are not allowed with binary suffix {suffix!r} in {value!r}; "
                f"use {number}{suffix.lower()} for a decimal multiple"
            )
        return int(number) * _BINARY_SUFFIX[suffix]
    return int(float(number) * _DECIMAL_SUFFIX[suffix])


def parse_list(value: str | list[str]) -> list[str]:
    """``'["a", "b"]'`` (JSON, as ``vllm serve --allowed-origins`` takes it) or ``"a,b"``."""
    if isinstance(value, list):
        return [str(item) for item in value]
    text = str(value).strip()
    if text.startswith("["):
        import json

        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"expected a JSON list of strings or a comma-separated list, got {value!r}: {exc}"
            ) from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ConfigError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_names(value: str | list[str]) -> list[str]:
    """Names given as separate arguments (``--lora-target-modules to_q to_k``, as vLLM takes them), each of which
    may also be a JSON or comma-separated list."""
    items = value if isinstance(value, list) else [value]
    return [name for item in items for name in parse_list(str(item))]


PARSERS = {
    "human_int": parse_human_int,
    "list": parse_list,
    "names": parse_names,
    "lora_modules": parse_lora_modules,
}


def build_config(file_values: Mapping[str, Any] | None = None, **overrides: Any) -> ServerConfig:
    """Merge YAML values and explicit overrides (overrides win) into a validated config.

    Unknown keys are rejected by name, with the list of valid ones; ``512M``-style sizes and list settings are
    parsed as their fields declare.
    """
    merged: dict[str, Any] = {}
    for source, values in (("config file", file_values or {}), ("arguments", overrides)):
        unknown = sorted(set(values) - set(FIELD_NAMES))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in {source}: {', '.join(unknown)}; valid settings are: " + ", ".join(FIELD_NAMES)
            )
        merged.update(values)
    for name, value in list(merged.items()):
        parse = declared(name)[1].get("parse")
        if parse is not None and value is not None:
            try:
                merged[name] = PARSERS[parse](value)
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None
    try:
        return msgspec.convert(merged, ServerConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__context__, ConfigError):  # raised by __post_init__ inside msgspec
            raise exc.__context__ from None
        # msgspec names the field as a path, e.g. "Expected `int` >= 1 - at `$.max_num_seqs`": say it in words
        # when it is a declared constraint, else pass msgspec's message on.
        match = re.search(r"at `\$\.(\w+)`", str(exc))
        if match and match.group(1) in merged:
            name = match.group(1)
            try:
                info, extra, _ = declared(name)
                problem = _constraint_problem(merged[name], info, extra.get("expected"))
            except TypeError:  # the value's type is wrong: msgspec's message says which type it wants
                problem = None
            if problem is not None:
                raise ConfigError(f"{name} {problem}; got {merged[name]!r} ({flag(name)})") from None
        raise ConfigError(f"invalid setting: {exc}") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file whose top level is a mapping of ``ServerConfig`` fields."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            f"config file {str(path)!r} must contain a mapping of settings at the top level, "
            f"got {type(values).__name__}"
        )
    return {str(key).replace("-", "_"): value for key, value in values.items()}
