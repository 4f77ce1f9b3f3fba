"""Cache mode parsing and KV sizing validation (spec D-1..D-3, M-25)."""

from __future__ import annotations

import pytest

from diffusion_kv import (
    DiffusionKVCacheMode,
    DiffusionKVConfig,
    is_scheduler_paged_kv_mode,
    parse_diffusion_kv_cache_mode,
    worker_row_pool_size,
)


def test_modes_parse_from_strings_and_members():
    assert parse_diffusion_kv_cache_mode("dense_legacy") is DiffusionKVCacheMode.DENSE_LEGACY
    assert parse_diffusion_kv_cache_mode("paged_scheduler") is DiffusionKVCacheMode.PAGED_SCHEDULER
    assert parse_diffusion_kv_cache_mode(DiffusionKVCacheMode.PAGED_SCHEDULER) is DiffusionKVCacheMode.PAGED_SCHEDULER


@pytest.mark.parametrize(
    "value", ["paged", "", "PAGED_SCHEDULER", "paged_worker_local", DiffusionKVCacheMode.PAGED_WORKER_LOCAL]
)
def test_unknown_and_reserved_modes_are_rejected(value):
    with pytest.raises(ValueError) as excinfo:
        parse_diffusion_kv_cache_mode(value)
    assert str(excinfo.value) == (
        f"Unsupported Diffusion KV diffusion_kv_mode {value!r}; expected one of: 'dense_legacy', 'paged_scheduler'"
    )


def test_only_paged_scheduler_is_scheduler_paged():
    assert is_scheduler_paged_kv_mode(DiffusionKVCacheMode.PAGED_SCHEDULER)
    assert is_scheduler_paged_kv_mode("paged_scheduler")
    assert not is_scheduler_paged_kv_mode(DiffusionKVCacheMode.DENSE_LEGACY)
    assert not is_scheduler_paged_kv_mode(DiffusionKVCacheMode.PAGED_WORKER_LOCAL)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes must be non-negative"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be positive"),
        ({"max_model_len": 0}, "max_model_len must be positive or -1"),
        ({"max_model_len": -2}, "max_model_len must be positive or -1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        (
            {"diffusion_kv_mode": "paged_scheduler"},
            "paged_scheduler requires a positive diffusion_kv_max_rows_per_request",
        ),
        (
            {"diffusion_kv_max_rows_per_request": 0},
            "diffusion_kv_max_rows_per_request must be a positive integer, got 0",
        ),
    ],
)
def test_sizing_fields_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        DiffusionKVConfig(**fields)


def test_zero_budget_and_auto_fit_sentinel_are_accepted():
    config = DiffusionKVConfig(kv_cache_memory_bytes=0, max_model_len=-1)
    assert config.kv_cache_memory_bytes == 0 and config.max_model_len == -1
    assert not config.is_paged


def test_diffusion_kv_sizing_fields_roundtrip():
    config = DiffusionKVConfig(
        diffusion_kv_mode="paged_scheduler",
        kv_cache_memory_bytes=4096,
        gpu_memory_utilization=0.75,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        max_num_seqs=4,
        diffusion_kv_max_rows_per_request=4,
    )
    data = config.to_dict()
    assert data["diffusion_kv_mode"] == "paged_scheduler"
    assert (data["kv_cache_memory_bytes"], data["gpu_memory_utilization"]) == (4096, 0.75)
    assert (data["max_num_batched_tokens"], data["max_model_len"]) == (2048, 4096)
    assert DiffusionKVConfig.from_dict(data) == config
    assert config.worker_row_pool_size == 16


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"Unknown Diffusion KV config keys \['max_model_length'\]"):
        DiffusionKVConfig.from_dict({"max_model_length": 10})


def test_worker_row_pool_size():
    assert worker_row_pool_size(4, 4) == 16
    with pytest.raises(ValueError, match="paged_scheduler requires a positive diffusion_kv_max_rows_per_request"):
        worker_row_pool_size(4, 0)
    with pytest.raises(ValueError, match="dense_legacy mode has no Worker row pool"):
        _ = DiffusionKVConfig().worker_row_pool_size
