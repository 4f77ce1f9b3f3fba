"""DiffusionKVRequest / DiffusionKVContext validation and their native Request surface."""

from __future__ import annotations

import pytest
import torch
from kv_builders import native_kv_cache_config

from diffusion_kv import (
    DiffusionKVContext,
    DiffusionKVRequest,
    RequestStatus,
    context_request_id,
    sequence_request_id,
)
from diffusion_kv.request import _ContextKVRequest


def _request(**overrides):
    fields = dict(sequence_id=0, prefix_len=3, target_len=5, seq_len=8)
    fields.update(overrides)
    request_id = fields.pop("request_id", "req/diffusion-kv/0")
    return DiffusionKVRequest(request_id, **fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"request_id": ""}, "request_id must be non-empty"),
        ({"sequence_id": -1}, "sequence_id must be non-negative, got -1"),
        ({"prefix_len": -2}, "prefix_len must be non-negative, got -2"),
        ({"target_len": 0}, "target_len must be positive, got 0"),
        ({"seq_len": 0, "prefix_len": 0, "target_len": 1}, "seq_len must be positive, got 0"),
        (
            {"prefix_len": 4, "target_len": 5, "seq_len": 8},
            "prefix_len + target_len must not exceed seq_len: prefix_len=4, target_len=5, seq_len=8",
        ),
    ],
)
def test_request_validation_messages(overrides, message):
    with pytest.raises(ValueError) as excinfo:
        _request(**overrides)
    assert str(excinfo.value) == message


def test_request_rejects_non_integer_lengths():
    with pytest.raises(TypeError, match="seq_len must be an int, got float"):
        _request(seq_len=8.0)
    with pytest.raises(TypeError, match="prefix_len must be an int, got bool"):
        _request(prefix_len=True)


def test_request_rejects_non_context_values():
    with pytest.raises(TypeError, match="kv_contexts must contain only DiffusionKVContext values"):
        _request(kv_contexts=[{"context_id": "text"}])


def test_request_rejects_duplicate_context_ids():
    text = DiffusionKVContext("text", "cross.text", 4)
    with pytest.raises(ValueError, match=r"kv_contexts must have unique context_id values, got \['text', 'text'\]"):
        _request(kv_contexts=[text, DiffusionKVContext("text", "cross.text", 8)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "cross.text", 4), "context_id must be non-empty"),
        (("text", "", 4), "cache_role must be non-empty"),
        (("text", "cross.text", 0), "num_tokens must be positive, got 0"),
    ],
)
def test_context_validation_messages(args, message):
    with pytest.raises(ValueError) as excinfo:
        DiffusionKVContext(*args)
    assert str(excinfo.value) == message


def test_context_is_frozen_value_with_tuple_hashes():
    context = DiffusionKVContext("text", "cross.text", 4, block_hashes=[b"a", b"b"])
    assert context.block_hashes == (b"a", b"b")
    assert context == DiffusionKVContext("text", "cross.text", 4, (b"a", b"b"))
    assert context != DiffusionKVContext("text", "cross.image", 4, (b"a", b"b"))
    with pytest.raises(AttributeError):
        context.num_tokens = 5  # type: ignore[misc]


def test_request_exposes_the_native_request_surface():
    request = _request(block_hashes=[b"h0"], prompt_token_ids=[1, 2])
    assert request.request_id == "req/diffusion-kv/0"
    assert (request.num_tokens, request.seq_len, request.num_prompt_tokens) == (8, 8, 3)
    assert request.num_computed_tokens == 0
    assert request.block_hashes == [b"h0"]
    assert request.skip_reading_prefix_cache is False
    assert request.status is RequestStatus.WAITING
    assert (request.num_preemptions, request.num_in_flight_tokens, request.shared_prefix_boundary) == (0, 0, 0)
    assert request.prompt_token_ids == [1, 2]
    assert _request().skip_reading_prefix_cache is True
    with pytest.raises(AttributeError):
        request.seq_len = 9  # read-only alias of num_tokens


def test_context_shim_never_reads_the_prefix_cache():
    context = DiffusionKVContext("text", "cross.text", 6, block_hashes=(b"x",))
    shim = _ContextKVRequest("pub", context)
    assert shim.request_id == "pub/diffusion-kv/context/text" == context_request_id("pub", "text")
    assert (shim.num_tokens, shim.num_prompt_tokens, shim.num_computed_tokens) == (6, 6, 0)
    assert shim.block_hashes == [b"x"]
    assert shim.skip_reading_prefix_cache is True
    assert shim.prompt_token_ids is None
    assert shim.status is RequestStatus.WAITING


def test_internal_id_helpers():
    assert sequence_request_id("pub", 1) == "pub/diffusion-kv/1"


def test_request_status_mirrors_vllm():
    vllm_request = pytest.importorskip("vllm.v1.request")
    native = vllm_request.RequestStatus
    assert [(s.name, int(s)) for s in RequestStatus] == [(s.name, int(s)) for s in native]
    assert RequestStatus.WAITING == native.WAITING
    assert RequestStatus.FINISHED_ABORTED.is_finished and not RequestStatus.PREEMPTED.is_finished


def test_native_kv_cache_manager_allocates_and_frees_the_request_and_shim():
    """Conformance: a real KVCacheManager drives both objects through allocate_slots/free."""
    config = native_kv_cache_config(8, num_kv_heads=1, dtype=torch.float16)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    native = KVCacheManager(
        kv_cache_config=config, max_model_len=64, scheduler_block_size=4, hash_block_size=4, enable_caching=False
    )
    idle = native.block_pool.get_num_free_blocks()
    request = _request(seq_len=8)
    shim = _ContextKVRequest("req", DiffusionKVContext("text", "cross.text", 5))
    for row, blocks in ((request, 2), (shim, 2)):
        allocated = native.allocate_slots(
            row, num_new_tokens=row.num_tokens, delay_cache_blocks=True, full_sequence_must_fit=True
        )
        assert allocated is not None
        assert len(native.get_block_ids(row.request_id)[0]) == blocks
    assert native.block_pool.get_num_free_blocks() == idle - 4
    native.free(request)
    native.free(shim)
    assert native.block_pool.get_num_free_blocks() == idle
