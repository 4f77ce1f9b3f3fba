"""Server configuration: one typed struct built from defaults, a YAML file and CLI flags.

Precedence (highest first): explicit CLI flags > YAML file > the defaults below.

Invariant: a ``ServerConfig`` that exists is valid. Every field is checked at
construction, and every combination that cannot work fails there with a
``ConfigError`` whose message names the field(s) and says what to change, so a
bad start-up never gets as far as loading weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

DEFAULT_MODEL = "omni-shapes-tiny"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """An invalid setting or combination of settings; the message says what to change."""


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
        raise ConfigError(
            f"expected an integer like 4096, 512M (binary) or 1.5g (decimal), got {value!r}"
        )
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


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the API process and the engine process need to start.

    It is a msgspec struct so the API process can hand it to the engine process as bytes.
    """

    # model
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    device: str = "auto"
    dtype: Dtype = "auto"
    seed: int = 0
    # scheduling and KV cache
    max_num_seqs: int = 16
    max_rows_per_step: int = 8  # CFG rows per forward (omni_server.scheduling_policy); 0: no limit
    batch_invariant: bool = False  # one job per forward: batched images bit-equal to single-request ones
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    # weights
    enable_layerwise_offload: bool = False
    offload_resident_layers: int = 0
    quantization: Literal["fp8"] | None = None
    fp8_cache_dir: str | None = None
    # several GPUs for one request (omni_server.workers): world size = cfg_parallel_size x sequence_parallel_size
    cfg_parallel_size: int = 1
    sequence_parallel_size: int = 1
    offload_allgather: bool = False
    # frontend
    host: str = "127.0.0.1"
    port: int = 8000
    engine_start_timeout_s: float = 600.0
    warmup: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # bounds on what a client controls (see omni_server.http_guard and the README's "Limits")
    max_request_body_bytes: int = 2**20
    max_prompt_chars: int = 2000
    max_error_message_chars: int = 2000
    max_header_bytes: int = 16 * 2**10
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_queued_requests: int = 32
    request_timeout_s: float = 600.0  # 0 disables
    shutdown_timeout_s: float = 30.0
    # supervision of the engine process
    engine_restarts: int = 5
    engine_heartbeat_timeout_s: float = 0.5
    # HTTP security
    api_key: str | None = None
    allowed_origins: list[str] = []
    allowed_hosts: list[str] | None = None  # None: loopback names when bound to loopback, else any host

    def __post_init__(self) -> None:
        _validate(self)
        _validate_limits(self)

    @property
    def model_name(self) -> str:
        """The name clients pass as ``model`` (defaults to the model argument)."""
        return self.served_model_name or self.model

    @property
    def world_size(self) -> int:
        """Ranks (one process per GPU) that serve each request: CFG-parallel x sequence-parallel."""
        return self.cfg_parallel_size * self.sequence_parallel_size

    def resolved_device(self) -> str:
        """``auto`` becomes ``cuda`` when a CUDA device is visible, else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _validate(cfg: ServerConfig) -> None:
    if not cfg.model:
        raise ConfigError("model must be a model name or a directory; got an empty string")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {cfg.device!r}")
    if cfg.max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1; got {cfg.max_num_seqs}")
    if cfg.max_rows_per_step < 0:
        raise ConfigError(f"max_rows_per_step must be >= 0 (0: no limit); got {cfg.max_rows_per_step}")
    if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
        raise ConfigError(f"block_size must be a positive power of two; got {cfg.block_size}")
    if cfg.kv_cache_memory_bytes is not None and cfg.kv_cache_memory_bytes < 0:
        raise ConfigError(
            "kv_cache_memory_bytes must be non-negative (0 or unset sizes the pool automatically); "
            f"got {cfg.kv_cache_memory_bytes}"
        )
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1]; got {cfg.gpu_memory_utilization}")
    if cfg.max_model_len is not None and cfg.max_model_len != -1 and cfg.max_model_len < 1:
        raise ConfigError(f"max_model_len must be positive or -1 (auto); got {cfg.max_model_len}")
    if cfg.offload_resident_layers < 0:
        raise ConfigError(f"offload_resident_layers must be >= 0; got {cfg.offload_resident_layers}")
    if cfg.offload_resident_layers and not cfg.enable_layerwise_offload:
        raise ConfigError(
            "offload_resident_layers only applies to layerwise offload; "
            "add --enable-layerwise-offload or drop --offload-resident-layers"
        )
    if cfg.cfg_parallel_size not in (1, 2):
        raise ConfigError(
            f"cfg_parallel_size must be 1 or 2 (one rank per CFG branch); got {cfg.cfg_parallel_size} "
            "(--cfg-parallel-size)"
        )
    if cfg.sequence_parallel_size < 1:
        raise ConfigError(f"sequence_parallel_size must be >= 1; got {cfg.sequence_parallel_size} "
                          "(--sequence-parallel-size)")
    if cfg.offload_allgather and not cfg.enable_layerwise_offload:
        raise ConfigError("--offload-allgather shards the offloaded block weights; add --enable-layerwise-offload "
                          "or drop --offload-allgather")
    if cfg.offload_allgather and cfg.sequence_parallel_size < 2:
        raise ConfigError(
            "--offload-allgather shards block weights over the sequence-parallel group (the DLO group is DP, else "
            "SP; CFG ranks never share weights), so it needs --sequence-parallel-size >= 2"
        )
    if cfg.offload_allgather and cfg.offload_resident_layers:
        raise ConfigError("--offload-allgather streams every block from the ranks' shards; drop "
                          "--offload-resident-layers (resident blocks need rank-local offload)")
    if cfg.fp8_cache_dir is not None and cfg.quantization != "fp8":
        raise ConfigError(
            "fp8_cache_dir caches FP8 weights, so it needs --quantization fp8; "
            "add --quantization fp8 or drop --fp8-cache-dir"
        )
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port must be in [0, 65535]; got {cfg.port}")
    if cfg.engine_start_timeout_s <= 0:
        raise ConfigError(f"engine_start_timeout_s must be positive; got {cfg.engine_start_timeout_s}")


def _validate_limits(cfg: ServerConfig) -> None:
    for name in ("max_request_body_bytes", "max_prompt_chars", "max_error_message_chars", "max_header_bytes",
                 "max_header_count"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1; got {getattr(cfg, name)}")
    for name in ("header_timeout_s", "body_timeout_s", "engine_heartbeat_timeout_s"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be positive; got {getattr(cfg, name)}")
    for name in ("request_timeout_s", "shutdown_timeout_s"):
        if not getattr(cfg, name) >= 0:
            raise ConfigError(f"{name} must be >= 0 (0: {'no timeout' if name == 'request_timeout_s' else 'no drain'}); "
                              f"got {getattr(cfg, name)}")
    if cfg.max_queued_requests < 0:
        raise ConfigError(f"max_queued_requests must be >= 0; got {cfg.max_queued_requests}")
    if cfg.engine_restarts < 0:
        raise ConfigError(f"engine_restarts must be >= 0 (0 disables restarts); got {cfg.engine_restarts}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ConfigError("api_key must not be empty; drop --api-key to serve without one")


FIELD_NAMES: tuple[str, ...] = ServerConfig.__struct_fields__
_HUMAN_INT_FIELDS = frozenset({"kv_cache_memory_bytes", "max_model_len", "max_request_body_bytes",
                               "max_header_bytes"})
_LIST_FIELDS = frozenset({"allowed_origins", "allowed_hosts"})


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
            raise ConfigError(f"expected a JSON list of strings or a comma-separated list, got {value!r}: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ConfigError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [item.strip() for item in text.split(",") if item.strip()]


def build_config(file_values: Mapping[str, Any] | None = None, **overrides: Any) -> ServerConfig:
    """Merge YAML values and explicit overrides (overrides win) into a validated config.

    Unknown keys are rejected by name, with the list of valid ones.
    """
    merged: dict[str, Any] = {}
    for source, values in (("config file", file_values or {}), ("arguments", overrides)):
        unknown = sorted(set(values) - set(FIELD_NAMES))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in {source}: {', '.join(unknown)}; valid settings are: "
                + ", ".join(FIELD_NAMES)
            )
        merged.update(values)
    for fields, parse in ((_HUMAN_INT_FIELDS, parse_human_int), (_LIST_FIELDS, parse_list)):
        for name in fields & merged.keys():
            if merged[name] is not None:
                try:
                    merged[name] = parse(merged[name])
                except ConfigError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
    try:
        return msgspec.convert(merged, ServerConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__context__, ConfigError):  # raised by _validate inside msgspec
            raise exc.__context__ from None
        # msgspec names the field as a path, e.g. "Expected `int`, got `str` - at `$.port`".
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
