"""KV pool sizing: memory budget -> blocks, profiled headroom, rank-local and scheduler configs.

The budget for the KV pool on one rank is either explicit (`kv_cache_memory_bytes`) or the
headroom a real profile forward leaves: `requested_memory - non_kv_memory`, where
`requested_memory = ceil(total_device_memory * gpu_memory_utilization)` is fixed before the
model loads and `non_kv_memory` is what the loaded model needs at its peak (weights,
activations of the largest profile request, and memory outside torch's allocator such
as the CUDA context). Headroom, not current free memory, is what counts: memory the
profile freed again is still needed by the next forward.

Configs: with vLLM importable, rank-local and scheduler `KVCacheConfig`s come from vLLM's
`get_kv_cache_configs` / `generate_scheduler_kv_cache_config`; otherwise a built-in
equivalent for one full-attention group gives the same block count and auto-fit length.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from diffusion_kv import _vllm
from diffusion_kv._validation import check_positive_int
from diffusion_kv.specs import AttentionCacheSpec

NO_MEMORY_LEFT_HINT = "Increase gpu_memory_utilization or reduce the maximum profile request shape."
DEFAULT_MAX_MODEL_LEN_LIMIT = 1 << 24


def kv_cache_bytes_per_block(specs: dict[str, AttentionCacheSpec], block_size: int) -> int:
    """Bytes one block id costs across every cache-enabled layer (each layer has its own page)."""
    if not specs:
        raise ValueError("no cache-enabled layers to size a KV pool for")
    check_positive_int("block_size", block_size)
    return sum(spec.page_size_bytes(block_size) for spec in specs.values())


def kv_budget_from_headroom(*, requested_memory: int, non_kv_memory: int) -> int:
    """`requested_memory - non_kv_memory`, or RuntimeError with both numbers when nothing is left."""
    available = requested_memory - non_kv_memory
    if available <= 0:
        raise RuntimeError(
            "No memory remains for Diffusion KV cache after profiling: "
            f"requested_memory={requested_memory} bytes, non_kv_cache_memory={non_kv_memory} bytes. "
            + NO_MEMORY_LEFT_HINT
        )
    return available


def requested_device_memory(device: torch.device | str, gpu_memory_utilization: float) -> int:
    """`ceil(total_memory * gpu_memory_utilization)` of a CUDA device; fails if less is free now.

    Call it before the model loads: the result is this rank's whole memory target.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    device = _cuda_device(device, "measuring requested device memory")
    free, total = torch.cuda.mem_get_info(device)
    requested = math.ceil(total * gpu_memory_utilization)
    if free < requested:
        raise RuntimeError(
            f"{device} has {free} bytes free but gpu_memory_utilization={gpu_memory_utilization} requests "
            f"{requested} of its {total} bytes; lower gpu_memory_utilization or free the device"
        )
    return requested


def profile_non_kv_memory(profile_forward: Callable[[], Any], device: torch.device | str) -> int:
    """Run one real profile forward and return the peak device memory it needs outside the KV cache.

    Peak = torch's peak allocation during the forward (weights stay allocated, so they
    are included) plus memory outside torch's allocator (CUDA context, library workspaces).
    """
    device = _cuda_device(device, "profiling non-KV memory")
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward()
    torch.cuda.synchronize(device)
    peak_torch = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return peak_torch + outside_torch


def determine_available_kv_memory(
    profile_forward: Callable[[], Any],
    *,
    device: torch.device | str,
    requested_memory: int,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """This rank's KV pool budget in bytes.

    An explicit, truthy `kv_cache_memory_bytes` wins, but the profile forward still runs
    exactly once (it initialises lazy kernels and buffers). `0` and `None` both mean
    auto: budget = `requested_memory - non_kv_memory` of the profile forward.
    """
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 0:
        raise ValueError(f"kv_cache_memory_bytes must be non-negative, got {kv_cache_memory_bytes}")
    if kv_cache_memory_bytes:
        profile_forward()
        return kv_cache_memory_bytes
    non_kv = profile_non_kv_memory(profile_forward, device)
    return kv_budget_from_headroom(requested_memory=requested_memory, non_kv_memory=non_kv)


@dataclass(frozen=True)
class BuiltinKVCacheConfig:
    """The built-in (no vLLM) equivalent of a one-group, full-attention `KVCacheConfig`.

    `num_blocks` includes the allocator's null block, as in vLLM. Every layer owns one
    tensor of `num_blocks` pages; `page_size_bytes[name]` is one layer's page.
    """

    num_blocks: int
    block_size: int
    layer_names: tuple[str, ...]
    page_size_bytes: tuple[int, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(self.page_size_bytes)


@dataclass(frozen=True)
class KVCacheConfigs:
    """Rank-local configs (one per rank), the scheduler's config, and the resolved lengths.

    `rank_configs`/`scheduler_config` are vLLM `KVCacheConfig`s when `source == "vllm"`,
    `BuiltinKVCacheConfig`s otherwise. All ranks share `num_blocks` (the smallest rank's).
    """

    rank_configs: tuple[Any, ...]
    scheduler_config: Any
    num_blocks: int
    block_size: int
    max_model_len: int
    source: Literal["vllm", "builtin"]


def build_kv_cache_configs(
    rank_specs: Sequence[dict[str, AttentionCacheSpec]],
    available_memory: Sequence[int],
    *,
    block_size: int,
    max_model_len: int,
    max_model_len_limit: int = DEFAULT_MAX_MODEL_LEN_LIMIT,
    use_vllm: bool | None = None,
) -> KVCacheConfigs:
    """Size the pool from each rank's budget; `max_model_len=-1` auto-fits it to the pool.

    `use_vllm=None` uses vLLM when importable. The pool must hold one `max_model_len` row
    besides the null block, else ValueError naming the numbers.
    """
    if len(rank_specs) != len(available_memory) or not rank_specs:
        raise ValueError(
            f"need one spec dict and one memory budget per rank, got {len(rank_specs)} and {len(available_memory)}"
        )
    check_positive_int("block_size", block_size)
    if max_model_len != -1:
        check_positive_int("max_model_len (or -1 to auto-fit)", max_model_len)
    for rank, (specs, memory) in enumerate(zip(rank_specs, available_memory)):
        if specs != rank_specs[0]:
            raise ValueError(f"rank {rank} discovered different cache layers than rank 0; every rank needs the same")
        kv_cache_bytes_per_block(specs, block_size)  # validates
        if not isinstance(memory, int) or memory <= 0:
            raise ValueError(f"rank {rank} has KV memory budget {memory!r}; it must be a positive int of bytes")
    if use_vllm is None:
        use_vllm = _vllm.vllm_available()
    if use_vllm:
        rank_configs, scheduler_config, resolved = _vllm.build_vllm_kv_cache_configs(
            list(rank_specs), list(available_memory), block_size=block_size,
            max_model_len=max_model_len, max_model_len_limit=max_model_len_limit,
        )
        return KVCacheConfigs(
            tuple(rank_configs), scheduler_config, scheduler_config.num_blocks, block_size, resolved, "vllm"
        )
    return _build_builtin_configs(rank_specs, available_memory, block_size, max_model_len, max_model_len_limit)


def _build_builtin_configs(rank_specs, available_memory, block_size, max_model_len, max_model_len_limit):
    specs = rank_specs[0]
    bytes_per_block = kv_cache_bytes_per_block(specs, block_size)
    num_blocks = min(memory // bytes_per_block for memory in available_memory)
    usable_tokens = max(num_blocks - 1, 0) * block_size  # one block is the allocator's null block
    if max_model_len == -1:
        resolved = min(usable_tokens, max_model_len_limit)
        if resolved <= 0:
            raise ValueError(
                "Cannot auto-fit max_model_len: not enough KV memory for a single token "
                f"({min(available_memory)} bytes, {bytes_per_block} bytes per block incl. the null block)"
            )
    else:
        resolved = max_model_len
        if usable_tokens < max_model_len:
            raise ValueError(
                f"KV memory of {min(available_memory)} bytes holds {num_blocks} blocks of {block_size} tokens "
                f"({usable_tokens} usable tokens after the null block), fewer than max_model_len={max_model_len}; "
                "raise the budget or lower max_model_len"
            )
    config = BuiltinKVCacheConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        layer_names=tuple(specs),
        page_size_bytes=tuple(spec.page_size_bytes(block_size) for spec in specs.values()),
    )
    return KVCacheConfigs(tuple(config for _ in rank_specs), config, num_blocks, block_size, resolved, "builtin")


def _cuda_device(device: torch.device | str, what: str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"{what} needs a CUDA device, got {device}; on CPU pass an explicit kv_cache_memory_bytes budget"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
