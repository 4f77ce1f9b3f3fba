"""Pool sizing: the budget and geometry of `size_kv_pool`, and configs from vLLM's utilities vs the built-in path.

The profiled budget needs CUDA: `test_memory.py` runs it on a real device."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import _vllm
from diffusion_kv.sizing import build_kv_cache_configs, kv_cache_bytes_per_block, size_kv_pool
from diffusion_kv.specs import AttentionCacheSpec

needs_vllm = pytest.mark.skipif(not _vllm.vllm_available(), reason="vLLM not installed")


def specs(num_layers=2, heads=2, head_size=64, dtype=torch.float16):
    return {
        f"blocks.{i}.attn": AttentionCacheSpec(f"blocks.{i}.attn", "primary", heads, head_size, dtype)
        for i in range(num_layers)
    }


def test_bytes_per_block_sums_every_layer_page():
    assert kv_cache_bytes_per_block(specs(), 16) == 2 * (16 * 2 * 2 * 64 * 2)


def test_an_explicit_budget_sizes_the_pool_without_a_profile():
    page = kv_cache_bytes_per_block(specs(), 16)
    calls = []
    sizing = size_kv_pool(
        specs(),
        block_size=16,
        max_row_tokens=100,
        kv_cache_memory_bytes=20 * page + 7,
        requested_memory=1 << 40,
        profile_forward=lambda: calls.append(1) or 0,
        device="cpu",
    )
    assert calls == []  # the explicit budget wins: nothing is profiled
    assert (sizing.num_blocks, sizing.block_size, sizing.bytes_per_block) == (20, 16, page)
    assert sizing.max_model_len == 100  # unset: the longest row
    assert sizing.source == f"kv_cache_memory_bytes={20 * page + 7}"


def test_without_a_profile_the_pool_holds_the_fallback_rows():
    page = kv_cache_bytes_per_block(specs(), 16)
    sizing = size_kv_pool(specs(), block_size=16, max_row_tokens=100, fallback_rows=6)
    assert sizing.num_blocks == 6 * 7 + 1  # 7 blocks per 100-token row, and the null block
    assert sizing.num_blocks * sizing.bytes_per_block == (6 * 7 + 1) * page
    assert sizing.source == "no profile: 6 rows of 100 tokens and the null block"


def test_auto_fit_max_model_len_never_exceeds_the_longest_row():
    page = kv_cache_bytes_per_block(specs(), 16)
    small = size_kv_pool(specs(), block_size=16, max_row_tokens=100, max_model_len=-1, kv_cache_memory_bytes=5 * page)
    assert small.max_model_len == 64  # 4 usable blocks after the null block
    large = size_kv_pool(specs(), block_size=16, max_row_tokens=100, max_model_len=-1, kv_cache_memory_bytes=50 * page)
    assert large.max_model_len == 100
    assert (
        size_kv_pool(
            specs(), block_size=16, max_row_tokens=100, max_model_len=48, kv_cache_memory_bytes=50 * page
        ).max_model_len
        == 48
    )


def test_a_budget_below_one_row_names_its_source_and_the_smallest_budget():
    page = kv_cache_bytes_per_block(specs(), 16)
    with pytest.raises(ValueError) as excinfo:
        size_kv_pool(specs(), block_size=16, max_row_tokens=100, kv_cache_memory_bytes=1)
    message = str(excinfo.value)
    assert message.startswith("cannot size the KV pool from kv_cache_memory_bytes=1: ")
    assert message.endswith(f"one row of 100 tokens needs a budget of at least {8 * page} bytes")


def test_a_profiled_budget_needs_a_cuda_device_and_a_profile():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu; on CPU pass an explicit"):
        size_kv_pool(
            specs(),
            block_size=16,
            max_row_tokens=100,
            requested_memory=1 << 30,
            profile_forward=lambda: 0,
            device="cpu",
        )
    with pytest.raises(ValueError, match="needs profile_forward and the CUDA device"):
        size_kv_pool(specs(), block_size=16, max_row_tokens=100, requested_memory=1 << 30)


@pytest.mark.parametrize("use_vllm", [False, pytest.param(True, marks=needs_vllm)])
def test_auto_fit_to_pool(use_vllm):
    page = kv_cache_bytes_per_block(specs(), 16)
    configs = build_kv_cache_configs(
        [specs()], [17 * page + page // 2], block_size=16, max_model_len=-1, use_vllm=use_vllm
    )
    assert configs.num_blocks == 17 and configs.max_model_len == 256  # 16 usable blocks x 16 after the null block
    assert configs.source == ("vllm" if use_vllm else "builtin")
    assert configs.scheduler_config.num_blocks == 17
    assert all(c.num_blocks == 17 for c in configs.rank_configs)


@pytest.mark.parametrize("use_vllm", [False, pytest.param(True, marks=needs_vllm)])
def test_ranks_share_the_smallest_pool(use_vllm):
    page = kv_cache_bytes_per_block(specs(), 16)
    configs = build_kv_cache_configs(
        [specs(), specs()], [40 * page, 33 * page], block_size=16, max_model_len=512, use_vllm=use_vllm
    )
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
