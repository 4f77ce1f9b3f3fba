"""Paged K/V ops (torch path, and the Triton path on CUDA when present) against dense SDPA."""

from __future__ import annotations

import pytest
import torch
from kv_builders import as_i32, build_paged_rows, packed_qkv, row_metadata, sdpa_row

from diffusion_kv import PagedAttentionMetadata, paged_attention, write_kv_cache

BACKENDS = ["torch"] + (["triton"] if torch.cuda.is_available() else [])
DEVICE = {"torch": "cpu", "triton": "cuda"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_case_prefix_then_suffix_matches_sdpa(backend):
    """fp16, 2 heads x 64, block 16, blocks [3, 1]: a 17-token prefix forward, then a 2-token suffix."""
    device = DEVICE[backend]
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16, device=device)
    q, k, v = packed_qkv(19, 2, 2, 64, torch.float16, device, gen)
    assert not k.is_contiguous() and not v.is_contiguous()

    prefix = row_metadata([[3, 1]], [(0, 17)], 16, device)
    assert prefix.slot_mapping.tolist() == list(range(48, 64)) + [16]
    write_kv_cache(k[:17], v[:17], kv_cache, prefix, backend=backend)
    out = paged_attention(q[:17], kv_cache, prefix, backend=backend)
    torch.testing.assert_close(out.float(), sdpa_row(q[:17], k[:17], v[:17]), rtol=2e-2, atol=2e-2)

    before = kv_cache.clone()
    suffix = row_metadata([[3, 1]], [(17, 2)], 16, device)
    assert suffix.slot_mapping.tolist() == [17, 18] and suffix.seq_lens.tolist() == [19]
    write_kv_cache(k[17:], v[17:], kv_cache, suffix, backend=backend)
    changed = (kv_cache != before).flatten(3).any(-1)  # [block, kv, offset]
    assert changed.nonzero().tolist() == [[1, 0, 1], [1, 0, 2], [1, 1, 1], [1, 1, 2]]
    out = paged_attention(q[17:], kv_cache, suffix, backend=backend)
    torch.testing.assert_close(out.float(), sdpa_row(q[17:], k, v), rtol=2e-2, atol=2e-2)
    assert out.dtype == torch.float16 and out.shape == (2, 2, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_rows_match_sdpa(backend, num_heads, num_kv_heads, dtype):
    """Three rows with different cached prefixes and query spans, scattered over a shuffled pool."""
    device = DEVICE[backend]
    rows = [(0, 13), (20, 5), (3, 30)]  # (query_pos_start, num_queries) ; seq_len = start + queries
    args, queries, dense = build_paged_rows(
        rows, num_heads, num_kv_heads, 32, 8, dtype, seed=1, device=device, backend=backend, spare_blocks=3, pad_block=0
    )
    expected = [sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)]
    out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=device)
    result = paged_attention(*args, out=out, backend=backend)
    assert result is out
    torch.testing.assert_close(out.float(), torch.cat(expected), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_prefix_mask_and_scale(backend):
    """Prefix queries attend causally within the prefix; target queries attend to every key."""
    device = DEVICE[backend]
    gen = torch.Generator().manual_seed(2)
    block_size, prefix, total = 4, 6, 15
    kv_cache = torch.zeros(6, 2, block_size, 2, 16, dtype=torch.float32, device=device)
    ids = [5, 0, 3, 2]
    q, k, v = packed_qkv(total, 4, 2, 16, torch.float32, device, gen)
    pos = torch.arange(total)
    masked = row_metadata([ids], [(0, total)], block_size, device, causal_prefix_lens=[prefix])
    write_kv_cache(k, v, kv_cache, masked, backend=backend)
    out = paged_attention(q, kv_cache, masked, scale=0.3, backend=backend)
    allowed = (pos[:, None] >= prefix) | (pos[None, :] <= pos[:, None])
    ref = sdpa_row(q, k, v, mask=allowed.to(device), scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # The mask matters: the same call without it differs for the prefix queries only.
    plain = paged_attention(
        q, kv_cache, row_metadata([ids], [(0, total)], block_size, device), scale=0.3, backend=backend
    )
    assert not torch.allclose(plain[: prefix - 1], out[: prefix - 1], atol=1e-3)
    torch.testing.assert_close(plain[prefix:], out[prefix:], rtol=1e-5, atol=1e-5)


def test_slot_mapping_is_computed_from_the_block_tables():
    """Two rows written at different spans: each token's slot follows its own row's table."""
    metadata = row_metadata([[2, 7, 0], [5, 1, 4]], [(3, 3), (8, 2)], 4, "cpu")
    assert metadata.slot_mapping.tolist() == [11, 28, 29, 16, 17]
    assert metadata.query_start_loc.tolist() == [0, 3, 5] and metadata.num_tokens == 5
    assert metadata.max_query_len == 3 and metadata.causal_prefix_lens is None


def _slots(slot_mapping) -> PagedAttentionMetadata:
    """Write-only metadata: one row, and exactly the given slots (the plain constructor trusts them)."""
    slots = torch.tensor(slot_mapping, dtype=torch.int64)
    n = slots.shape[0]
    return PagedAttentionMetadata(
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_start_loc=as_i32([0, n], "cpu"),
        seq_lens=as_i32([n], "cpu"),
        query_pos_start=as_i32([0], "cpu"),
        slot_mapping=slots,
        causal_prefix_lens=None,
        block_size=4,
        num_tokens=n,
        max_query_len=n,
    )


def test_negative_slots_are_skipped():
    kv_cache = torch.zeros(2, 2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    write_kv_cache(key, -key, kv_cache, _slots([5, -1, 0]))
    assert kv_cache[1, 0, 1].eq(1).all() and kv_cache[0, 1, 0].eq(-1).all()
    assert int((kv_cache != 0).flatten(3).any(-1).sum()) == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"key": torch.ones(3, 2, 8)}, "key must have shape"),
        ({"value": torch.ones(3, 1, 8, dtype=torch.float16)}, "value dtype"),
        ({"metadata": _slots([0, 1])}, "key has 3 tokens but the metadata describes 2"),
        ({"metadata": _slots([0, 1, 8])}, "beyond the pool's 8 slots"),
        ({"kv_cache": torch.zeros(2, 3, 4, 1, 8)}, "kv_cache must have shape"),
        ({"kv_cache": torch.zeros(4, 2, 2, 1, 8)}, "blocks of 2 tokens but the metadata was built for block_size=4"),
    ],
)
def test_write_rejects_bad_inputs_and_changes_nothing(kwargs, match):
    args = {
        "key": torch.ones(3, 1, 8),
        "value": torch.ones(3, 1, 8),
        "kv_cache": torch.zeros(2, 2, 4, 1, 8),
        "metadata": _slots([0, 1, 2]),
    }
    args.update(kwargs)
    snapshot = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)
    assert torch.equal(args["kv_cache"], snapshot)


def _attention_args(query=None, block_tables=((0, 1), (2, 3)), rows=((0, 3), (6, 2)), **metadata):
    return {
        "query": torch.randn(5, 4, 8) if query is None else query,
        "kv_cache": torch.zeros(4, 2, 4, 2, 8),
        "metadata": row_metadata([list(t) for t in block_tables], list(rows), 4, "cpu", **metadata),
    }


@pytest.mark.parametrize(
    "update,match",
    [
        ({"query": torch.randn(5, 3, 8)}, "multiple of the cache's num_kv_heads"),
        ({"query": torch.randn(5, 4, 8, dtype=torch.float16)}, "query dtype"),
        ({"query": torch.randn(4, 4, 8)}, "query has 4 tokens but the metadata describes 5"),
        ({"block_tables": ((0, 1), (2, 4))}, r"must lie in \[0, 4\)"),
    ],
)
def test_attention_rejects_bad_inputs(update, match):
    args = _attention_args(**update)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)
    with pytest.raises(ValueError, match="out must match query"):
        paged_attention(**_attention_args(), out=torch.empty(5, 4, 4))


@pytest.mark.parametrize(
    "rows,block_tables,kwargs,match",
    [
        ([(6, 2)], [[0, 1]], {"seq_lens": [7]}, "beyond seq_len=7"),
        ([(7, 2)], [[0, 1]], {}, r"seq_len=9 exceeds the block table width \(2 blocks x 4 = 8 tokens\)"),
        ([(0, 3)], [[0, 1], [2, 3]], {}, "query_lens must have 2 entries"),
        ([(0, 3)], [[0, 1]], {"query_pos_start": [-1]}, "must hold ints >= 0"),
    ],
)
def test_metadata_build_rejects_bad_rows(rows, block_tables, kwargs, match):
    args = {
        "query_lens": [n for _, n in rows],
        "seq_lens": [s + n for s, n in rows],
        "query_pos_start": [s for s, _ in rows],
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PagedAttentionMetadata.build(as_i32(block_tables, "cpu"), block_size=4, **args)


def test_metadata_constructor_rejects_inconsistent_tensors():
    good = row_metadata([[0, 1]], [(0, 3)], 4, "cpu")
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[1\] for 1 rows"):
        PagedAttentionMetadata(**{**vars(good), "seq_lens": as_i32([3, 3], "cpu")})
    with pytest.raises(ValueError, match="query_pos_start must be a torch.int32 tensor"):
        PagedAttentionMetadata(**{**vars(good), "query_pos_start": torch.zeros(1, dtype=torch.int64)})


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(**_attention_args(), backend="cuda")
