"""KV pool sizing: memory target -> budget -> blocks, as vLLM's `determine_available_memory` + `get_kv_cache_config`.

Two phases, because the memory target must be fixed before the weights load:

1. `requested_device_memory(device, gpu_memory_utilization)` = `ceil(total * gpu_memory_utilization)` of a CUDA
   device, called before the model loads: this rank's whole memory target;
2. `size_kv_pool(specs, ...)`, once the model is loaded: the budget (explicit `kv_cache_memory_bytes`; or the
   headroom `requested_memory - non_kv_memory` of one real profile forward, where `non_kv_memory` is what the
   loaded model needs at its peak: weights, activations of the largest batch, and memory outside torch's
   allocator such as the CUDA context; or, with no profile, a number of full-length rows), then the pool geometry
   (`KVPoolSizing`). Headroom, not current free memory, is what counts: memory the profile freed again is still
   needed by the next forward.

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
from diffusion_kv._validation import cdiv, check_positive_int
from diffusion_kv.specs import AttentionCacheSpec

NO_MEMORY_LEFT_HINT = "Increase gpu_memory_utilization or reduce the maximum profile request shape."
DEFAULT_MAX_MODEL_LEN_LIMIT = 1 << 24


def kv_cache_bytes_per_block(specs: dict[str, AttentionCacheSpec], block_size: int) -> int:
    """Bytes one block id costs across every cache-enabled layer (each layer has its own page)."""
    if not specs:
        raise ValueError("no cache-enabled layers to size a KV pool for")
    check_positive_int("block_size", block_size)
    return sum(spec.page_size_bytes(block_size) for spec in specs.values())


def requested_device_memory(device: torch.device | str, gpu_memory_utilization: float) -> int:
    """`ceil(total_memory * gpu_memory_utilization)` of a CUDA device; fails if less is free now.

    Call it before the model loads: the result is this rank's whole memory target (`size_kv_pool`'s
    `requested_memory`).
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


@dataclass(frozen=True)
class KVPoolSizing:
    """One rank's KV pool and how it was sized (its `repr` is the start-up log line).

    `num_blocks` includes the allocator's null block, as in vLLM; `bytes_per_block` is one block id across every
    cache-enabled layer (the pool is `num_blocks * bytes_per_block` bytes); `source` says where the budget came
    from, with its numbers.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    source: str


def size_kv_pool(
    specs: dict[str, AttentionCacheSpec],
    *,
    block_size: int,
    max_row_tokens: int,
    max_model_len: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    requested_memory: int | None = None,
    profile_forward: Callable[[], int] | None = None,
    device: torch.device | str | None = None,
    fallback_rows: int = 1,
) -> KVPoolSizing:
    """Size this rank's KV pool for `specs`: the budget, then the geometry (`build_kv_cache_configs`).

    The budget is the first of:

    1. `kv_cache_memory_bytes`, when truthy (no profile runs);
    2. with `requested_memory` (from `requested_device_memory`, measured before the weights loaded): the headroom
       `requested_memory - non_kv_memory` of one `profile_forward()` on the CUDA `device`. It runs the largest
       batch the engine forms, over a KV pool it allocates for that batch, and returns that pool's `num_blocks`:
       those blocks are KV, not non-KV memory, so their bytes come off the measured peak (it may release the pool
       before it returns). No headroom left is a `RuntimeError` with both numbers;
    3. otherwise (no peak-memory probe, as on the CPU): `fallback_rows` rows of `max_row_tokens` tokens plus the
       null block.

    `max_row_tokens` is the longest row any request can produce; `max_model_len` None means that row, `-1` fits
    it down to what the pool holds (never above `max_row_tokens`). A budget that cannot hold one `max_model_len`
    row is a `ValueError` naming the budget's source and the smallest budget for one `max_row_tokens` row.
    """
    check_positive_int("max_row_tokens", max_row_tokens)
    check_positive_int("fallback_rows", fallback_rows)
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 0:
        raise ValueError(f"kv_cache_memory_bytes must be non-negative, got {kv_cache_memory_bytes}")
    bytes_per_block = kv_cache_bytes_per_block(specs, block_size)
    blocks_per_row = cdiv(max_row_tokens, block_size)
    if kv_cache_memory_bytes:
        budget, source = kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    elif requested_memory is not None:
        if profile_forward is None or device is None:
            raise ValueError("a profiled budget (requested_memory) needs profile_forward and the CUDA device")
        non_kv = _profile_non_kv_memory(profile_forward, device, bytes_per_block)
        budget = requested_memory - non_kv
        if budget <= 0:
            raise RuntimeError(
                "No memory remains for Diffusion KV cache after profiling: "
                f"requested_memory={requested_memory} bytes, non_kv_cache_memory={non_kv} bytes. " + NO_MEMORY_LEFT_HINT
            )
        source = f"profiled: requested_memory={requested_memory} - non_kv_memory={non_kv} bytes"
    else:
        budget = (fallback_rows * blocks_per_row + 1) * bytes_per_block
        source = f"no profile: {fallback_rows} rows of {max_row_tokens} tokens and the null block"
    try:
        configs = build_kv_cache_configs(
            [specs],
            [budget],
            block_size=block_size,
            max_model_len=max_row_tokens if max_model_len is None else max_model_len,
            max_model_len_limit=max_row_tokens,
        )
    except ValueError as exc:
        raise ValueError(
            f"cannot size the KV pool from {source}: {exc}; one row of {max_row_tokens} tokens needs a budget of "
            f"at least {(blocks_per_row + 1) * bytes_per_block} bytes"
        ) from None
    return KVPoolSizing(configs.num_blocks, block_size, bytes_per_block, configs.max_model_len, source)


def _profile_non_kv_memory(profile_forward: Callable[[], int], device: torch.device | str, bytes_per_block: int) -> int:
    """Run the profile forward once; the peak device memory it needs outside the KV cache.

    Peak = torch's peak allocation during the forward (weights stay allocated, so they are included) plus memory
    outside torch's allocator (CUDA context, library workspaces), less the profile's own KV pool.
    """
    device = _cuda_device(device, "profiling non-KV memory")
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_blocks = profile_forward()
    torch.cuda.synchronize(device)
    peak_torch = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return peak_torch + outside_torch - profile_blocks * bytes_per_block


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
    for rank, (specs, memory) in enumerate(zip(rank_specs, available_memory, strict=True)):
        if specs != rank_specs[0]:
            raise ValueError(f"rank {rank} discovered different cache layers than rank 0; every rank needs the same")
        kv_cache_bytes_per_block(specs, block_size)  # validates
        if not isinstance(memory, int) or memory <= 0:
            raise ValueError(f"rank {rank} has KV memory budget {memory!r}; it must be a positive int of bytes")
    if use_vllm is None:
        use_vllm = _vllm.vllm_available()
    if use_vllm:
        rank_configs, scheduler_config, resolved = _vllm.build_vllm_kv_cache_configs(
            list(rank_specs),
            list(available_memory),
            block_size=block_size,
            max_model_len=max_model_len,
            max_model_len_limit=max_model_len_limit,
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
