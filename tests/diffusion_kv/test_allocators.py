"""The two block allocators: shared semantics, and block-for-block parity with vLLM."""

from __future__ import annotations

import random

import pytest
from kv_builders import BLOCK_SIZE, build_allocator, native_kv_cache_config, pool_config

from diffusion_kv import BlockAllocator, BlockPoolConfig, BuiltinBlockPool, DiffusionKVRequest
from diffusion_kv.allocator import build_block_allocator


def _row(request_id: str, num_tokens: int) -> DiffusionKVRequest:
    return DiffusionKVRequest(request_id, sequence_id=0, prefix_len=0, target_len=num_tokens, seq_len=num_tokens)


def _allocator(kind: str, num_blocks: int) -> BlockAllocator:
    return build_allocator(kind, pool_config(kind, num_blocks), max_model_len=1024)


def test_idle_pool_reserves_the_null_block(kind):
    allocator = _allocator(kind, 5)
    assert allocator.empty_pool_free_blocks == 4
    assert allocator.get_num_free_blocks() == 4
    assert allocator.num_groups == 1
    assert allocator.owned_request_ids() == frozenset()


def test_allocation_takes_ceil_blocks_and_free_restores_physical_order(kind):
    allocator = _allocator(kind, 8)
    a, b = _row("a", 8), _row("b", 9)
    assert allocator.blocks_for_full_reservation(9) == 3
    assert allocator.allocate(a) == ([1, 2],)
    assert allocator.allocate(b) == ([3, 4, 5],)
    assert allocator.get_num_free_blocks() == 2
    assert allocator.owned_request_ids() == {"a", "b"}
    allocator.free(b)
    allocator.free(a)
    assert allocator.get_num_free_blocks() == 7
    # Freed ascending at the head of the queue: a 5-block row gets them back in order.
    assert allocator.allocate(_row("c", 20)) == ([1, 2, 3, 4, 5],)


def test_capacity_returns_none_and_changes_nothing(kind):
    allocator = _allocator(kind, 4)
    assert allocator.allocate(_row("a", 8)) == ([1, 2],)
    assert allocator.allocate(_row("b", 8)) is None
    assert allocator.get_num_free_blocks() == 1
    assert allocator.owned_request_ids() == {"a"}


def test_freeing_an_unknown_row_is_a_noop(kind):
    allocator = _allocator(kind, 4)
    allocator.free(_row("never", 4))
    assert allocator.get_num_free_blocks() == 3


def test_native_and_builtin_hand_out_identical_blocks():
    """Parity: one random operation sequence, the same block ids from both allocators."""
    builtin, native = _allocator("builtin", 17), _allocator("native", 17)
    rng = random.Random(7)
    live: dict[str, DiffusionKVRequest] = {}
    for step in range(300):
        if live and rng.random() < 0.45:
            row = live.pop(rng.choice(sorted(live)))
            builtin.free(row)
            native.free(row)
        else:
            row = _row(f"r{step}", rng.randint(1, 4 * BLOCK_SIZE))
            got = builtin.allocate(row), native.allocate(row)
            assert got[0] == got[1], f"step {step}"
            if got[0] is not None:
                live[row.request_id] = row
        assert builtin.get_num_free_blocks() == native.get_num_free_blocks()
        assert builtin.owned_request_ids() == native.owned_request_ids() == set(live)


def test_full_reservation_figure_matches_the_native_coordinator():
    native = _allocator("native", 8)
    coordinator = native.native_manager.coordinator
    for tokens in (1, 4, 5, 31):
        expected = coordinator.get_num_blocks_to_allocate(
            request_id="probe",
            num_tokens=tokens,
            new_computed_blocks=native.native_manager.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=0,
            total_computed_tokens=0,
            num_local_computed_tokens=0,
            num_tokens_main_model=tokens,
            apply_admission_cap=True,
        )
        assert (
            native.blocks_for_full_reservation(tokens)
            == expected
            == _allocator("builtin", 8).blocks_for_full_reservation(tokens)
        )


def test_builtin_pool_can_be_built_from_a_vllm_config():
    allocator = build_block_allocator(
        native_kv_cache_config(6, block_size=16),
        allocator="builtin",
        max_model_len=64,
        scheduler_block_size=16,
        hash_block_size=16,
        max_in_flight_tokens=None,
    )
    assert isinstance(allocator, BuiltinBlockPool)
    assert (allocator.num_blocks, allocator.block_size) == (6, 16)


def test_native_allocator_needs_a_vllm_config():
    pytest.importorskip("vllm")
    from diffusion_kv._vllm import NativeBlockAllocator

    with pytest.raises(TypeError, match="needs a vllm.v1.kv_cache_interface.KVCacheConfig, got BlockPoolConfig"):
        NativeBlockAllocator(BlockPoolConfig(4, 4), max_model_len=16, scheduler_block_size=4, hash_block_size=4)


def test_unknown_allocator_choice_is_rejected():
    with pytest.raises(ValueError, match="allocator must be 'auto', 'native', 'builtin'"):
        build_block_allocator(
            BlockPoolConfig(4, 4),
            allocator="fast",  # type: ignore[arg-type]
            max_model_len=16,
            scheduler_block_size=4,
            hash_block_size=4,
            max_in_flight_tokens=None,
        )


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (4, True)])
def test_pool_config_is_validated(num_blocks, block_size):
    with pytest.raises(ValueError, match="BlockPoolConfig"):
        BlockPoolConfig(num_blocks, block_size)
