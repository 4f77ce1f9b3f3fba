"""DiffusionKVCacheManager over both allocators (the native one is a real vLLM KVCacheManager)."""

from __future__ import annotations

import functools

import pytest
from kv_builders import BLOCK_SIZE, DelegatingAllocator, build_allocator, cfg_rows, native_kv_cache_config, pool_config

from diffusion_kv import (
    BlockPoolConfig,
    DiffusionKVAdmissionError,
    DiffusionKVCacheManager,
    DiffusionKVContext,
    DiffusionKVInvariantError,
    DiffusionKVRequest,
    sequence_request_id,
)


@pytest.fixture
def make_manager(kind):
    def make(num_blocks: int = 8, *, max_rows: int = 4, max_model_len: int = 64, wrap=None):
        config = pool_config(kind, num_blocks)
        allocator = build_allocator(kind, config, max_model_len=max_model_len)
        if wrap is not None:
            allocator = wrap(allocator)
        return DiffusionKVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            max_rows_per_request=max_rows,
            allocator=allocator,
        )

    return make


_seqs = functools.partial(cfg_rows, prefix_len=3)


def _assert_empty(manager: DiffusionKVCacheManager) -> None:
    assert manager._requests == {} and manager._context_requests == {} and manager._metadata == {}
    assert manager._internal_request_ids == set()
    assert manager.allocator.owned_request_ids() == frozenset()
    assert manager.get_num_free_blocks() == manager.empty_pool_num_free_blocks
    manager.check_invariants()


class Spy(DelegatingAllocator):
    """Delegating allocator wrapper: counts allocate calls and can raise AFTER the n-th real allocation."""

    def __init__(self, inner, fail_after_call: int | None = None):
        super().__init__(inner)
        self.fail_after_call = fail_after_call

    def allocate(self, request):
        result = super().allocate(request)
        if self.allocate_calls == self.fail_after_call:
            assert result is not None  # the failure really comes after a real allocation
            raise RuntimeError("injected allocation failure")
        return result


def test_default_allocator_is_the_real_native_manager_when_vllm_is_importable():
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    manager = DiffusionKVCacheManager(
        native_kv_cache_config(8), max_model_len=64, scheduler_block_size=4, hash_block_size=4, max_rows_per_request=2
    )
    assert isinstance(manager.native_manager, KVCacheManager)
    assert manager.native_manager.enable_caching is False
    builtin = DiffusionKVCacheManager(
        BlockPoolConfig(8, 4),
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=4,
        max_rows_per_request=2,
        allocator="builtin",
    )
    assert builtin.native_manager is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be positive, got 0"),
        ({"scheduler_block_size": 0}, "scheduler_block_size and hash_block_size must be positive"),
        ({"hash_block_size": -4}, "scheduler_block_size and hash_block_size must be positive"),
        ({"max_rows_per_request": 2.0}, "max_rows_per_request must be a positive integer, got 2.0"),
        ({"max_rows_per_request": True}, "max_rows_per_request must be a positive integer, got True"),
        ({"max_in_flight_tokens": 0}, "max_in_flight_tokens must be positive when provided, got 0"),
        (
            {"scheduler_block_size": 16},
            "scheduler_block_size (16) must equal the pool's block_size (4): a BlockPoolConfig has one KV-cache group",
        ),
    ],
)
def test_constructor_validation(overrides, message):
    kwargs = dict(
        max_model_len=64, scheduler_block_size=4, hash_block_size=4, max_rows_per_request=2, allocator="builtin"
    )
    kwargs.update(overrides)
    with pytest.raises(ValueError) as excinfo:
        DiffusionKVCacheManager(BlockPoolConfig(8, 4), **kwargs)
    assert str(excinfo.value) == message


def test_reserve_and_free_multi_cfg_request(make_manager):
    manager = make_manager(8)
    idle = manager.get_num_free_blocks()
    metadata = manager.reserve_request("pub", _seqs("pub", 2))
    assert metadata is not None and metadata.allocation_generation == 1
    assert metadata.request_id == "pub" and metadata.contexts == ()
    for index, sequence in enumerate(metadata.sequences):
        assert (sequence.sequence_id, sequence.prefix_len, sequence.target_len, sequence.seq_len) == (index, 3, 5, 8)
        assert len(sequence.block_ids) == 1 and len(sequence.block_ids[0]) == 2
        assert sequence.context_ids == () and sequence.num_computed_tokens == 0
    assert manager.get_num_free_blocks() == idle - 4
    assert manager.has_request("pub") and manager.get_metadata("pub") == metadata
    manager.check_invariants()
    manager.free_request("pub")
    assert not manager.has_request("pub")
    _assert_empty(manager)
    manager.free_request("pub")  # idempotent


def test_impossible_cfg_allocation_fails_fast_before_allocating(make_manager):
    manager = make_manager(3, wrap=Spy)
    with pytest.raises(DiffusionKVAdmissionError) as excinfo:
        manager.reserve_request("big", _seqs("big", 2))
    assert str(excinfo.value).startswith(
        "Diffusion KV request 'big' cannot fit even when the block pool is empty: required_blocks=4, available_blocks=2"
    )
    assert manager.allocator.allocate_calls == 0
    _assert_empty(manager)


def test_impossible_cfg_allocation_fails_fast_while_pool_is_busy(make_manager):
    manager = make_manager(5)
    assert manager.reserve_request("busy", _seqs("busy", 1)) is not None
    with pytest.raises(DiffusionKVAdmissionError, match="required_blocks=6, available_blocks=4"):
        manager.reserve_request("big", _seqs("big", 3))
    assert manager.get_num_free_blocks() == 2 and not manager.has_request("big")


def test_empty_pool_bound_counts_context_blocks(make_manager):
    manager = make_manager(5)
    text = DiffusionKVContext("text", "cross.text", 12)  # 3 blocks
    with pytest.raises(DiffusionKVAdmissionError, match="required_blocks=5, available_blocks=4"):
        manager.reserve_request("ctx", _seqs("ctx", 1, contexts=(text,)))
    _assert_empty(manager)


def test_blocks_required_is_what_a_reservation_takes_and_touches_nothing(make_manager):
    manager = make_manager(16, wrap=Spy)
    text = DiffusionKVContext("text", "cross.text", 12)  # 3 blocks, shared by both rows
    rows = _seqs("pub", 2, contexts=(text,))  # 2 + 2 blocks
    assert manager.blocks_required("pub", rows) == 7
    assert manager.allocator.allocate_calls == 0
    _assert_empty(manager)
    free = manager.get_num_free_blocks()
    assert manager.reserve_request("pub", rows) is not None
    assert free - manager.get_num_free_blocks() == 7
    with pytest.raises(DiffusionKVAdmissionError, match="'pub' is already allocated"):
        manager.blocks_required("pub", rows)
    with pytest.raises(DiffusionKVAdmissionError, match="required_blocks=16, available_blocks=15"):
        manager.blocks_required("big", _seqs("big", 1, seq_len=64))


def test_temporary_capacity_pressure_returns_none_then_retries(make_manager):
    manager = make_manager(5)
    assert manager.reserve_request("first", _seqs("first", 1)) is not None
    waiting = _seqs("second", 2)
    # Row 0 fits (2 of 2 free blocks), row 1 does not: the partial row is rolled back.
    assert manager.reserve_request("second", waiting) is None
    assert not manager.has_request("second") and manager.get_num_free_blocks() == 2
    assert manager.allocator.owned_request_ids() == {"first/diffusion-kv/0"}
    manager.check_invariants()
    manager.free_request("first")
    metadata = manager.reserve_request("second", waiting)
    assert metadata is not None and metadata.allocation_generation == 2


def test_reallocated_request_gets_a_new_allocation_generation(make_manager):
    manager = make_manager(8)
    first = manager.reserve_request("pub", _seqs("pub", 1))
    manager.free_request("pub")
    second = manager.reserve_request("pub", _seqs("pub", 1))
    assert second.allocation_generation == first.allocation_generation + 1
    other = manager.reserve_request("other", _seqs("other", 1))
    assert other.allocation_generation == second.allocation_generation + 1


def test_allocator_exception_is_reraised_unchanged_after_rollback(make_manager):
    manager = make_manager(8, wrap=lambda inner: Spy(inner, fail_after_call=2))
    with pytest.raises(RuntimeError, match="^injected allocation failure$"):
        manager.reserve_request("pub", _seqs("pub", 2))
    _assert_empty(manager)


@pytest.mark.parametrize("fail_after_call", [1, 2, 3, 4], ids=["primary-0", "primary-1", "context-a", "context-b"])
def test_failure_after_real_allocation_at_every_row_is_fully_undone(make_manager, fail_after_call):
    """Each row joins the rollback list BEFORE its allocation, so a post-mutation failure leaks nothing."""
    spy_box = []

    def wrap(inner):
        spy_box.append(Spy(inner, fail_after_call=fail_after_call))
        return spy_box[0]

    manager = make_manager(16, wrap=wrap)
    contexts = (DiffusionKVContext("a", "cross.text", 8), DiffusionKVContext("b", "cross.image", 4))
    sequences = _seqs("pub", 2, contexts=contexts)
    with pytest.raises(RuntimeError, match="injected allocation failure"):
        manager.reserve_request("pub", sequences)
    assert spy_box[0].allocate_calls == fail_after_call
    assert not manager.has_request("pub")
    _assert_empty(manager)
    assert all(sequence.num_computed_tokens == 0 for sequence in sequences)

    spy_box[0].fail_after_call = None
    metadata = manager.reserve_request("pub", sequences)
    assert metadata is not None and [c.context_id for c in metadata.contexts] == ["a", "b"]
    assert manager.get_num_free_blocks() == manager.empty_pool_num_free_blocks - (2 + 2 + 2 + 1)
    manager.check_invariants()


def test_rollback_failure_is_an_invariant_error(make_manager):
    class BrokenFree(Spy):
        def free(self, request):
            raise RuntimeError("free exploded")

    manager = make_manager(8, wrap=lambda inner: BrokenFree(inner, fail_after_call=1))
    with pytest.raises(DiffusionKVInvariantError, match="rollback failed") as excinfo:
        manager.reserve_request("pub", _seqs("pub", 1))
    assert not isinstance(excinfo.value, ValueError)
    assert str(excinfo.value.__cause__) == "free exploded"


def test_leaked_internal_ids_are_an_invariant_error(make_manager):
    manager = make_manager(8)
    manager._internal_request_ids.add("pub/diffusion-kv/0")  # simulate a bookkeeping leak
    with pytest.raises(DiffusionKVInvariantError, match=r"already allocated: \['pub/diffusion-kv/0'\]"):
        manager.reserve_request("pub", _seqs("pub", 1))
    assert manager.allocator.owned_request_ids() == frozenset()


def test_rejects_sequence_longer_than_admission_bound(make_manager):
    manager = make_manager(8, max_model_len=8)
    with pytest.raises(DiffusionKVAdmissionError) as excinfo:
        manager.reserve_request("long", _seqs("long", 1, seq_len=9))
    assert str(excinfo.value) == (
        "Diffusion KV sequence 'long/diffusion-kv/0' exceeds max_model_len: seq_len=9, max_model_len=8"
    )
    _assert_empty(manager)


def test_rejects_context_longer_than_admission_bound(make_manager):
    manager = make_manager(8, max_model_len=8)
    text = DiffusionKVContext("text", "cross.text", 9)
    with pytest.raises(
        DiffusionKVAdmissionError, match="context 'text' exceeds max_model_len: num_tokens=9, max_model_len=8"
    ):
        manager.reserve_request("pub", _seqs("pub", 1, contexts=(text,)))
    _assert_empty(manager)


@pytest.mark.parametrize("order", [(1,), (1, 0), (0, 2)])
def test_rejects_ambiguous_sequence_order(make_manager, order):
    manager = make_manager(8)
    sequences = [
        DiffusionKVRequest(sequence_request_id("pub", s), sequence_id=s, prefix_len=0, target_len=4, seq_len=4)
        for s in order
    ]
    with pytest.raises(DiffusionKVAdmissionError, match="ordered by contiguous sequence_id values"):
        manager.reserve_request("pub", sequences)
    _assert_empty(manager)


@pytest.mark.parametrize(
    ("public_id", "sequences", "message"),
    [
        ("", lambda: _seqs("x", 1), "public_request_id must be non-empty"),
        ("pub", lambda: [], "Diffusion KV allocation requires at least one sequence"),
    ],
)
def test_rejects_malformed_calls(make_manager, public_id, sequences, message):
    manager = make_manager(8)
    with pytest.raises(DiffusionKVAdmissionError, match=message):
        manager.reserve_request(public_id, sequences())


def test_rejects_duplicate_internal_ids_and_double_reservation(make_manager):
    manager = make_manager(8)
    twins = [DiffusionKVRequest("same", sequence_id=index, prefix_len=0, target_len=4, seq_len=4) for index in range(2)]
    with pytest.raises(DiffusionKVAdmissionError, match=r"internal request IDs must be unique, got \['same', 'same'\]"):
        manager.reserve_request("pub", twins)
    manager.reserve_request("pub", _seqs("pub", 1))
    with pytest.raises(DiffusionKVAdmissionError, match="Diffusion KV request 'pub' is already allocated"):
        manager.reserve_request("pub", _seqs("pub", 1))


def test_sequence_ids_must_derive_from_the_public_id(make_manager):
    manager = make_manager(8)
    foreign = DiffusionKVRequest("other/diffusion-kv/0", sequence_id=0, prefix_len=0, target_len=4, seq_len=4)
    with pytest.raises(DiffusionKVAdmissionError) as excinfo:
        manager.reserve_request("pub", [foreign])
    assert str(excinfo.value) == (
        "Diffusion KV sequence 0 of request 'pub' must have request_id 'pub/diffusion-kv/0' "
        "(sequence_request_id), got 'other/diffusion-kv/0'"
    )
    _assert_empty(manager)


def test_get_metadata_of_unknown_request(make_manager):
    manager = make_manager(4, max_rows=1, max_model_len=8)
    with pytest.raises(KeyError, match="Diffusion KV request 'nope' is not allocated"):
        manager.get_metadata("nope")


def _reserve_with_a_text_context(manager, public_id: str, num_rows: int):
    """Reserve `num_rows` 8-token rows sharing one 8-token context; returns (metadata, blocks taken)."""
    idle = manager.get_num_free_blocks()
    text = DiffusionKVContext("text", "cross.text", 8)
    metadata = manager.reserve_request(public_id, _seqs(public_id, num_rows, contexts=(text,)))
    return metadata, idle - manager.get_num_free_blocks()


def test_reserves_request_scoped_context_and_releases_it_with_the_request(make_manager):
    manager = make_manager(8)
    metadata, taken = _reserve_with_a_text_context(manager, "public", 1)
    assert taken == 4
    (context,) = metadata.contexts
    assert (context.context_id, context.cache_role, context.num_tokens, len(context.block_ids[0])) == (
        "text",
        "cross.text",
        8,
        2,
    )
    assert metadata.sequences[0].context_ids == ("text",)
    (shim,) = manager._context_requests["public"]
    assert shim.request_id == "public/diffusion-kv/context/text"
    assert manager.allocator.owned_request_ids() == {"public/diffusion-kv/0", "public/diffusion-kv/context/text"}
    # The context never joins the sequence collection.
    assert [row.request_id for row in manager._requests["public"]] == ["public/diffusion-kv/0"]
    manager.free_request("public")
    _assert_empty(manager)


def test_context_with_block_hashes_never_reads_the_prefix_cache(kind, make_manager, monkeypatch):
    if kind != "native":
        pytest.skip("prefix-cache lookups exist only in the native manager")
    manager = make_manager(8)
    lookups = []
    monkeypatch.setattr(manager.native_manager, "get_computed_blocks", lambda request: lookups.append(request))
    text = DiffusionKVContext("text", "cross.text", 8, block_hashes=(b"h0", b"h1"))
    assert manager.reserve_request("pub", _seqs("pub", 1, contexts=(text,))) is not None
    (shim,) = manager._context_requests["pub"]
    assert shim.skip_reading_prefix_cache is True and shim.block_hashes == [b"h0", b"h1"]
    assert lookups == []


def test_shared_context_is_allocated_once_for_multiple_sequences(make_manager):
    metadata, taken = _reserve_with_a_text_context(make_manager(8), "pub", 2)
    assert taken == 6
    assert [s.context_ids for s in metadata.sequences] == [("text",), ("text",)]
    assert len(metadata.contexts) == 1 and metadata.num_rows == 3


def _four_token_row(sequence_id: int, *contexts: DiffusionKVContext) -> DiffusionKVRequest:
    """CFG row `sequence_id` of request "pub": 4 target tokens referencing `contexts` in that order."""
    return DiffusionKVRequest(
        sequence_request_id("pub", sequence_id),
        sequence_id=sequence_id,
        prefix_len=0,
        target_len=4,
        seq_len=4,
        kv_contexts=contexts,
    )


def test_sequences_keep_their_declared_context_order(make_manager):
    manager = make_manager(16)
    a, b = DiffusionKVContext("a", "cross.text", 4), DiffusionKVContext("b", "cross.image", 4)
    metadata = manager.reserve_request("pub", [_four_token_row(0, b, a), _four_token_row(1, a)])
    assert [s.context_ids for s in metadata.sequences] == [("b", "a"), ("a",)]
    assert [c.context_id for c in metadata.contexts] == ["b", "a"]  # first-seen order


def test_conflicting_shared_context_definitions_are_rejected_before_allocation(make_manager):
    manager = make_manager(8, wrap=Spy)
    first = _four_token_row(0, DiffusionKVContext("text", "cross.text", 4))
    second = _four_token_row(1, DiffusionKVContext("text", "cross.text", 8))
    with pytest.raises(DiffusionKVAdmissionError) as excinfo:
        manager.reserve_request("pub", [first, second])
    assert str(excinfo.value) == (
        "Diffusion KV sequences define conflicting request-scoped contexts: context_id='text'"
    )
    assert manager.allocator.allocate_calls == 0


def test_row_limit_rejects_contexts_before_allocation(make_manager):
    manager = make_manager(8, max_rows=2, wrap=Spy)
    text = DiffusionKVContext("text", "cross.text", 4)
    with pytest.raises(DiffusionKVAdmissionError) as excinfo:
        manager.reserve_request("too-many-rows", _seqs("too-many-rows", 2, contexts=(text,)))
    assert str(excinfo.value) == "Diffusion KV request 'too-many-rows' requires 3 rows; max_rows_per_request is 2"
    assert manager.allocator.allocate_calls == 0


def test_context_capacity_pressure_rolls_back_partial_request(make_manager):
    manager = make_manager(6)
    assert manager.reserve_request("holder", _seqs("holder", 1, seq_len=8)) is not None  # 2 blocks; 3 free
    text = DiffusionKVContext("text", "cross.text", 8)
    # Both sequences (1 block each) fit; the 2-block context does not: all three rows are undone.
    assert manager.reserve_request("pub", _seqs("pub", 2, seq_len=4, contexts=(text,))) is None
    assert manager.get_num_free_blocks() == 3 and not manager.has_request("pub")
    manager.check_invariants()


def test_close_releases_every_public_request(make_manager):
    manager = make_manager(16)
    text = DiffusionKVContext("text", "cross.text", 4)
    manager.reserve_request("a", _seqs("a", 2))
    manager.reserve_request("b", _seqs("b", 1, contexts=(text,)))
    manager.close()
    _assert_empty(manager)
    assert manager.num_requests == 0
