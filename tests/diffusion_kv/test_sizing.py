"""Pool sizing: budgets, headroom arithmetic, and configs from vLLM's utilities vs the built-in path."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import _vllm
from diffusion_kv.sizing import (
    build_kv_cache_configs,
    determine_available_kv_memory,
    kv_budget_from_headroom,
    kv_cache_bytes_per_block,
)
from diffusion_kv.specs import AttentionCacheSpec

needs_vllm = pytest.mark.skipif(not _vllm.vllm_available(), reason="vLLM not installed")


def specs(num_layers=2, heads=2, head_size=64, dtype=torch.float16):
    return {f"blocks.{i}.attn": AttentionCacheSpec(f"blocks.{i}.attn", "primary", heads, head_size, dtype)
            for i in range(num_layers)}


def test_bytes_per_block_sums_every_layer_page():
    assert kv_cache_bytes_per_block(specs(), 16) == 2 * (16 * 2 * 2 * 64 * 2)


@pytest.mark.parametrize("requested,non_kv,expected", [(750, 400, 350), (1000, 650, 350)])
def test_headroom_is_requested_minus_non_kv(requested, non_kv, expected):
    assert kv_budget_from_headroom(requested_memory=requested, non_kv_memory=non_kv) == expected


@pytest.mark.parametrize("non_kv", [750, 800])
def test_no_headroom_fails_with_the_numbers(non_kv):
    with pytest.raises(RuntimeError, match=rf"requested_memory=750 bytes, non_kv_cache_memory={non_kv} bytes\. "
                                           "Increase gpu_memory_utilization"):
        kv_budget_from_headroom(requested_memory=750, non_kv_memory=non_kv)


def test_explicit_budget_still_runs_the_profile_once_and_auto_needs_cuda_on_cpu():
    calls = []
    budget = determine_available_kv_memory(lambda: calls.append(1), device="cpu", requested_memory=10,
                                           kv_cache_memory_bytes=4096)
    assert budget == 4096 and calls == [1]
    for auto in (0, None):
        with pytest.raises(ValueError, match="needs a CUDA device, got cpu; on CPU pass an explicit"):
            determine_available_kv_memory(lambda: None, device="cpu", requested_memory=10, kv_cache_memory_bytes=auto)


@pytest.mark.parametrize("use_vllm", [False, pytest.param(True, marks=needs_vllm)])
def test_auto_fit_to_pool(use_vllm):
    page = kv_cache_bytes_per_block(specs(), 16)
    configs = build_kv_cache_configs([specs()], [17 * page + page // 2], block_size=16, max_model_len=-1,
                                     use_vllm=use_vllm)
    assert configs.num_blocks == 17 and configs.max_model_len == 256  # 16 usable blocks x 16 after the null block
    assert configs.source == ("vllm" if use_vllm else "builtin")
    assert configs.scheduler_config.num_blocks == 17
    assert all(c.num_blocks == 17 for c in configs.rank_configs)


@pytest.mark.parametrize("use_vllm", [False, pytest.param(True, marks=needs_vllm)])
def test_ranks_share_the_smallest_pool(use_vllm):
    page = kv_cache_bytes_per_block(specs(), 16)
    configs = build_kv_cache_configs([specs(), specs()], [40 * page, 33 * page], block_size=16, max_model_len=512,
                                     use_vllm=use_vllm)
    assert configs.num_blocks == 33 and configs.max_model_len == 512
    assert [c.num_blocks for c in configs.rank_configs] == [33, 33]


@pytest.mark.parametrize("use_vllm", [False, pytest.param(True, marks=needs_vllm)])
def test_pool_too_small_for_max_model_len(use_vllm):
    page = kv_cache_bytes_per_block(specs(), 16)
    with pytest.raises(ValueError, match="max_model_len|max seq len"):
        build_kv_cache_configs([specs()], [10 * page], block_size=16, max_model_len=4096, use_vllm=use_vllm)


@needs_vllm
@pytest.mark.parametrize("layers,heads,head_size,block_size,blocks", [(3, 4, 32, 16, 50), (1, 8, 128, 64, 9)])
def test_builtin_matches_vllm(layers, heads, head_size, block_size, blocks):
    s = specs(layers, heads, head_size, torch.bfloat16)
    memory = [blocks * kv_cache_bytes_per_block(s, block_size) + 123]
    native = build_kv_cache_configs([s], memory, block_size=block_size, max_model_len=-1, use_vllm=True)
    builtin = build_kv_cache_configs([s], memory, block_size=block_size, max_model_len=-1, use_vllm=False)
    assert (native.num_blocks, native.max_model_len) == (builtin.num_blocks, builtin.max_model_len)
    group = native.scheduler_config.kv_cache_groups
    assert len(group) == 1 and sorted(group[0].layer_names) == sorted(s)
    assert group[0].kv_cache_spec.non_causal


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"available_memory": [0]}, "positive int of bytes"),
        ({"available_memory": [1, 2]}, "one spec dict and one memory budget per rank"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"block_size": 0}, "block_size must be a positive int"),
    ],
)
def test_bad_sizing_inputs(kwargs, match):
    args = {"rank_specs": [specs()], "available_memory": [1 << 20], "block_size": 16, "max_model_len": 64}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_kv_cache_configs(**args)


def test_ranks_with_different_layers_are_rejected():
    with pytest.raises(ValueError, match="rank 1 discovered different cache layers"):
        build_kv_cache_configs([specs(2), specs(3)], [1 << 20, 1 << 20], block_size=16, max_model_len=64)
