"""Memory: the pool returns to its baseline after install/retire cycles; profiling without room fails loudly."""

from __future__ import annotations

import random

import pytest
import torch

from diffusion_kv import BlockPoolConfig, DiffusionKVCacheManager, DiffusionKVContext, DiffusionKVRequest
from diffusion_kv.batch import BatchRow, prepare_batch
from diffusion_kv.cache import allocate_kv_caches, kv_cache_bytes
from diffusion_kv.sizing import kv_cache_bytes_per_block, requested_device_memory, size_kv_pool
from diffusion_kv.specs import AttentionCacheSpec
from diffusion_kv.worker import RowIdentity, WorkerRowTable

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 8
SPECS = {
    "blocks.0.attn": AttentionCacheSpec("blocks.0.attn", "primary", 2, 32, torch.float16),
    "ar.attn": AttentionCacheSpec("ar.attn", "ar_decode", 2, 32, torch.float16),
}


def cfg_requests(public_id, prefix, target, with_context):
    contexts = (DiffusionKVContext("ar", "ar_decode", 12),) if with_context else ()
    return [
        DiffusionKVRequest(
            f"{public_id}/diffusion-kv/{sid}",
            sequence_id=sid,
            prefix_len=prefix,
            target_len=target,
            seq_len=prefix + target,
            kv_contexts=contexts,
        )
        for sid in range(2)
    ]


def test_pool_returns_to_baseline_after_install_retire_cycles():
    manager = DiffusionKVCacheManager(
        BlockPoolConfig(40, BLOCK),
        max_model_len=64,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        max_rows_per_request=3,
        allocator="builtin",
    )
    table = WorkerRowTable(
        num_rows=6,
        max_rows_per_request=3,
        num_blocks=40,
        block_size=BLOCK,
        max_model_len=64,
        registered_roles={"primary", "ar_decode"},
        device=DEVICE,
    )
    caches = allocate_kv_caches(SPECS, 40, BLOCK, device=DEVICE)
    free_blocks, free_rows = manager.get_num_free_blocks(), table.num_free_rows
    rng = random.Random(0)
    live: dict[str, int] = {}
    device_baseline = None
    for cycle in range(60):
        if live and (rng.random() < 0.5 or len(live) == 2):
            public_id = rng.choice(sorted(live))
            generation = live.pop(public_id)
            manager.free_request(public_id)
            assert table.remove([(public_id, generation)]) == 1
            continue
        public_id = f"req-{cycle % 3}"  # ids are reused across cycles
        if public_id in live:
            continue
        prefix, target = rng.randint(1, 20), rng.randint(1, 30)
        metadata = manager.reserve_request(public_id, cfg_requests(public_id, prefix, target, rng.random() < 0.5))
        assert metadata is not None
        assert table.install(metadata)
        live[public_id] = metadata.allocation_generation
        # One prefix forward over both CFG rows, as a model would run it.
        rows = [
            BatchRow(
                RowIdentity(public_id, sequence_id=s),
                query_len=prefix + target,
                seq_len=prefix + target,
                causal_prefix_len=prefix,
            )
            for s in range(2)
        ]
        batch = prepare_batch(table, rows)
        x = torch.randn(batch.metadata.num_tokens, 2, 32, dtype=torch.float16, device=DEVICE)
        batch.attention(SPECS["blocks.0.attn"], x, x, x, caches["blocks.0.attn"])
        if CUDA and device_baseline is None:
            torch.cuda.synchronize()
            device_baseline = torch.cuda.memory_allocated()
    for public_id, generation in live.items():
        manager.free_request(public_id)
        table.remove([(public_id, generation)])
    assert manager.get_num_free_blocks() == free_blocks and manager.num_requests == 0
    assert table.num_free_rows == free_rows and not table.installed_request_ids
    assert not table.block_tables.any()
    if CUDA:
        del batch, x
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= device_baseline


def _size_profiled(requested: int, profile_forward) -> object:
    return size_kv_pool(
        SPECS,
        block_size=64,
        max_row_tokens=4096,
        max_model_len=-1,
        requested_memory=requested,
        profile_forward=profile_forward,
        device="cuda",
    )


@pytest.mark.skipif(not CUDA, reason="profiling device memory needs CUDA (on CPU the budget is explicit)")
def test_profile_that_leaves_no_room_fails_with_the_numbers():
    requested = requested_device_memory("cuda", 0.001)  # ~0.1% of the card: less than the CUDA context alone

    def profile_forward():
        torch.empty(requested, dtype=torch.uint8, device="cuda").fill_(1)
        return 0

    with pytest.raises(RuntimeError) as excinfo:
        _size_profiled(requested, profile_forward)
    message = str(excinfo.value)
    assert message.startswith("No memory remains for Diffusion KV cache after profiling: ")
    assert f"requested_memory={requested} bytes, non_kv_cache_memory=" in message
    non_kv = int(message.split("non_kv_cache_memory=")[1].split(" ")[0])
    assert non_kv >= 2 * requested > 0  # the forward's own tensor plus everything outside torch


@pytest.mark.skipif(not CUDA, reason="profiling device memory needs CUDA")
def test_profiled_headroom_sizes_a_pool_that_fits():
    requested = requested_device_memory("cuda", 0.1)
    weights = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def profile_forward():
        activations = torch.randn(8192, 4096, device="cuda", dtype=torch.float16)
        (activations @ weights).sum().item()
        return 0

    sizing = _size_profiled(requested, profile_forward)
    assert sizing.source.startswith(f"profiled: requested_memory={requested} - non_kv_memory=")
    weights_and_peak_activations = weights.nbytes + 2 * 8192 * 4096 * 2  # activations and their product
    assert 0 < sizing.num_blocks * sizing.bytes_per_block <= requested - weights_and_peak_activations
    caches = allocate_kv_caches(SPECS, sizing.num_blocks, 64, device="cuda")
    assert kv_cache_bytes(caches) == sizing.num_blocks * sizing.bytes_per_block


@pytest.mark.skipif(not CUDA, reason="profiling device memory needs CUDA")
def test_the_profiles_own_kv_pool_is_not_counted_as_non_kv_memory():
    requested = requested_device_memory("cuda", 0.1)
    weights = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    profile_blocks = (256 << 20) // kv_cache_bytes_per_block(SPECS, 64)  # a 256 MiB profile pool

    def forward():
        activations = torch.randn(4096, 2048, device="cuda", dtype=torch.float16)
        (activations @ weights).sum().item()

    def forward_over_a_profile_pool():
        caches = allocate_kv_caches(SPECS, profile_blocks, 64, device="cuda")
        forward()
        del caches  # released before returning, as an engine drops its profile pool
        return profile_blocks

    without_pool = _size_profiled(requested, lambda: forward() or 0)
    with_pool = _size_profiled(requested, forward_over_a_profile_pool)
    # Counted as non-KV, the pool would take all of its 256 MiB off the budget.
    assert abs(with_pool.num_blocks - without_pool.num_blocks) <= profile_blocks // 100
