"""Batch preparation over a real row table, and role-checked paged attention end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffusion_kv.batch import BatchRow, prepare_batch
from diffusion_kv.cache import allocate_kv_caches
from diffusion_kv.metadata import DiffusionKVContextMetadata, DiffusionKVMetadata, DiffusionKVSequenceMetadata
from diffusion_kv.specs import AttentionCacheSpec
from diffusion_kv.worker import RowIdentity, WorkerRowTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRIMARY = AttentionCacheSpec("blocks.0.attn", "primary", 2, 64, torch.float16)
AR_DECODE = AttentionCacheSpec("ar.attn", "ar_decode", 2, 64, torch.float16)


def seed_table():
    return WorkerRowTable(
        num_rows=4,
        max_rows_per_request=2,
        num_blocks=4,
        block_size=16,
        max_model_len=32,
        registered_roles={"primary", "ar_decode"},
        device=DEVICE,
    )


def sdpa(q, k, v, mask=None):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(group, 1).transpose(0, 1).float(),
        v.repeat_interleave(group, 1).transpose(0, 1).float(),
        attn_mask=mask,
    ).transpose(0, 1)


@pytest.mark.parametrize("role", ["primary", "ar_decode"])
def test_seed_case_through_row_table_and_batches(role):
    """Blocks [3, 1] non-contiguous; 17-token prefix forward writes [48..63] + [16]; 2-token suffix writes [17, 18]."""
    t = seed_table()
    if role == "primary":
        identity, layer = RowIdentity("req", sequence_id=0), PRIMARY
        t.install(DiffusionKVMetadata("req", 1, (DiffusionKVSequenceMetadata(0, 17, 2, 19, ([3, 1],)),)))
    else:
        identity, layer = RowIdentity("req", context_id="ar"), AR_DECODE
        t.install(
            DiffusionKVMetadata(
                "req",
                1,
                (DiffusionKVSequenceMetadata(0, 0, 4, 4, ([0],), context_ids=("ar",)),),
                (DiffusionKVContextMetadata("ar", "ar_decode", 19, ([3, 1],)),),
            )
        )
    caches = allocate_kv_caches({"blocks.0.attn": PRIMARY, "ar.attn": AR_DECODE}, 4, 16, device=DEVICE)
    cache = caches[layer.layer_name]
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(19, 3 * 2 * 64, generator=gen).to(DEVICE, torch.float16)
    q, k, v = (x.view(19, 2, 64) for x in qkv.split(128, dim=-1))
    assert not k.is_contiguous()

    prefix = prepare_batch(t, [BatchRow(identity, query_len=17, seq_len=17, kv_start_pos=0)])
    assert prefix.metadata.slot_mapping.tolist() == list(range(48, 64)) + [16]
    assert prefix.cache_role == role and prefix.metadata.block_tables.tolist() == [[3, 1]]
    out = prefix.attention(layer, q[:17], k[:17], v[:17], cache)
    torch.testing.assert_close(out.float(), sdpa(q[:17], k[:17], v[:17]), rtol=2e-2, atol=2e-2)

    suffix = prepare_batch(t, [BatchRow(identity, query_len=2, seq_len=19, kv_start_pos=17)])
    assert suffix.metadata.slot_mapping.tolist() == [17, 18]
    out = suffix.attention(layer, q[17:], k[17:], v[17:], cache)
    torch.testing.assert_close(out.float(), sdpa(q[17:], k, v), rtol=2e-2, atol=2e-2)
    other = caches["ar.attn" if role == "primary" else "blocks.0.attn"]
    assert not other.any(), "a forward of one role must not touch another role's cache"


def test_ragged_rows_of_two_requests_with_causal_prefix():
    """Two CFG rows of one request plus a row of another, at different denoise spans, GQA 4:2."""
    layer = AttentionCacheSpec("attn", "primary", 2, 32, torch.float16)
    t = WorkerRowTable(
        num_rows=4,
        max_rows_per_request=2,
        num_blocks=16,
        block_size=8,
        max_model_len=40,
        registered_roles={"primary"},
        device=DEVICE,
    )
    shapes = {("a", 0): (6, 14, [9, 2, 14]), ("a", 1): (3, 13, [0, 7]), ("b", 0): (10, 20, [5, 11, 1, 3])}
    for request_id in ("a", "b"):
        sequences = tuple(
            DiffusionKVSequenceMetadata(sid, prefix, target, prefix + target, (blocks,))
            for (rid, sid), (prefix, target, blocks) in shapes.items()
            if rid == request_id
        )
        t.install(DiffusionKVMetadata(request_id, 3, sequences))
    cache = allocate_kv_caches({"attn": layer}, 16, 8, device=DEVICE)["attn"]
    gen = torch.Generator().manual_seed(12)
    dense = {}
    for (rid, sid), (prefix, target, _) in shapes.items():
        n = prefix + target
        qkv = torch.randn(n, 8 * 32, generator=gen).to(DEVICE, torch.float16)
        q, k, v = qkv.split([128, 64, 64], dim=-1)
        dense[(rid, sid)] = (q.view(n, 4, 32), k.view(n, 2, 32), v.view(n, 2, 32))
    # Forward 0 writes every row's prefix (causal within the prefix).
    rows = [BatchRow.prefix(RowIdentity(rid, sequence_id=sid), prefix) for (rid, sid), (prefix, _, _) in shapes.items()]
    batch = prepare_batch(t, rows)
    cat = lambda i, span: torch.cat([dense[key][i][span(key)] for key in shapes])  # noqa: E731
    batch.attention(
        layer,
        cat(0, lambda key: slice(0, shapes[key][0])),
        cat(1, lambda key: slice(0, shapes[key][0])),
        cat(2, lambda key: slice(0, shapes[key][0])),
        cache,
    )
    # A denoise step: target queries write their span and attend to everything.
    rows = [
        BatchRow.target(RowIdentity(rid, sequence_id=sid), prefix, target)
        for (rid, sid), (prefix, target, _) in shapes.items()
    ]
    batch = prepare_batch(t, rows, max_num_batched_tokens=48)
    assert batch.metadata.causal_prefix_lens is None
    assert batch.metadata.block_tables.tolist() == [[9, 2, 14, 0, 0], [0, 7, 0, 0, 0], [5, 11, 1, 3, 0]]
    assert batch.metadata.slot_mapping[:3].tolist() == [78, 79, 16]  # row a/0 writes positions 6.. of [9, 2, 14]
    target_span = lambda key: slice(shapes[key][0], None)  # noqa: E731
    out = batch.attention(layer, cat(0, target_span), cat(1, target_span), cat(2, target_span), cache)
    expected = torch.cat([sdpa(q[shapes[key][0] :], k, v) for key, (q, k, v) in dense.items()])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def installed_pair():
    t = seed_table()
    t.install(
        DiffusionKVMetadata(
            "req",
            1,
            (DiffusionKVSequenceMetadata(0, 0, 16, 16, ([0],), context_ids=("ar",)),),
            (DiffusionKVContextMetadata("ar", "ar_decode", 19, ([3, 1],)),),
        )
    )
    return t, RowIdentity("req", sequence_id=0), RowIdentity("req", context_id="ar")


@pytest.mark.parametrize(
    "rows,kwargs,match",
    [
        ([], {}, "batch is empty"),
        (["seq", "seq"], {}, "duplicate row identities"),
        (["seq", "ctx"], {}, r"one cache role per forward; got \['ar_decode', 'primary'\]"),
        (["long"], {}, "seq_len=17 is beyond its installed length of 16 tokens"),
        (["seq"], {"max_num_batched_tokens": 3}, "more than max_num_batched_tokens=3"),
        (["seq"] * 5, {}, "Worker capacity is 4"),
        (["unknown"], {}, "is not installed on this worker"),
    ],
)
def test_prepare_batch_rejections(rows, kwargs, match):
    t, seq_id, ctx_id = installed_pair()
    by_name = {
        "seq": BatchRow(seq_id, query_len=4, seq_len=16),
        "ctx": BatchRow(ctx_id, query_len=4, seq_len=19),
        "long": BatchRow(seq_id, query_len=1, seq_len=17, kv_start_pos=16),
        "unknown": BatchRow(RowIdentity("nope", sequence_id=0), query_len=1, seq_len=1),
    }
    with pytest.raises((ValueError, KeyError), match=match):
        prepare_batch(t, [by_name[name] for name in rows], **kwargs)


def test_batch_row_validation():
    with pytest.raises(ValueError, match=r"kv_start_pos \+ query_len \(3 \+ 2\) exceeds seq_len=4"):
        BatchRow(RowIdentity("r", sequence_id=0), query_len=2, seq_len=4, kv_start_pos=3)
    with pytest.raises(ValueError, match="query_len must be a positive int"):
        BatchRow(RowIdentity("r", sequence_id=0), query_len=0, seq_len=4)


def test_layer_of_another_role_and_stale_batches_are_rejected():
    t, seq_id, _ = installed_pair()
    caches = allocate_kv_caches({"blocks.0.attn": PRIMARY, "ar.attn": AR_DECODE}, 4, 16, device=DEVICE)
    batch = prepare_batch(t, [BatchRow(seq_id, query_len=2, seq_len=2)])
    x = torch.zeros(2, 2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(
        ValueError, match="layer 'ar.attn' uses cache role 'ar_decode', but the active rows use 'primary'"
    ):
        batch.attention(AR_DECODE, x, x, x, caches["ar.attn"])
    with pytest.raises(ValueError, match=r"query of shape \(3, 2, 64\) is not \[2, heads, 64\]"):
        batch.attention(
            PRIMARY, torch.zeros(3, 2, 64, dtype=torch.float16, device=DEVICE), x, x, caches["blocks.0.attn"]
        )
    t.remove(["req"])
    with pytest.raises(RuntimeError, match="batch is stale"):
        batch.attention(PRIMARY, x, x, x, caches["blocks.0.attn"])
    assert not caches["blocks.0.attn"].any()


def test_output_keeps_the_callers_token_layout():
    """[T, H, D], [T, H*D] and uniform batched [R, q, H*D] inputs give the same attention, in their own layout."""
    layer = AttentionCacheSpec("attn", "primary", 2, 16, torch.float32)
    t = WorkerRowTable(
        num_rows=2,
        max_rows_per_request=2,
        num_blocks=8,
        block_size=4,
        max_model_len=12,
        registered_roles={"primary"},
        device=DEVICE,
    )
    t.install(
        DiffusionKVMetadata(
            "r",
            1,
            tuple(
                DiffusionKVSequenceMetadata(s, 0, 10, 10, (blocks,)) for s, blocks in ((0, [1, 4, 6]), (1, [7, 0, 2]))
            ),
        )
    )
    rows = [BatchRow(RowIdentity("r", sequence_id=s), query_len=10, seq_len=10) for s in range(2)]
    gen = torch.Generator().manual_seed(13)
    qkv = torch.randn(2, 10, 4 * 16 + 2 * 2 * 16, generator=gen).to(DEVICE)
    q, k, v = qkv.split([64, 32, 32], dim=-1)  # batched [R, q, heads*D] views
    results = []
    for view in (
        lambda x: x,  # [R, q, H*D]
        lambda x: x.flatten(0, 1),  # [T, H*D]
        lambda x: x.flatten(0, 1).unflatten(1, (-1, 16)),  # [T, H, D]
    ):
        cache = allocate_kv_caches({"attn": layer}, 8, 4, device=DEVICE)["attn"]
        out = prepare_batch(t, rows).attention(layer, view(q), view(k), view(v), cache)
        assert out.shape == view(q).shape
        results.append(out.reshape(20, 4, 16))
    expected = torch.cat(
        [sdpa(q[i].unflatten(1, (4, 16)), k[i].unflatten(1, (2, 16)), v[i].unflatten(1, (2, 16))) for i in range(2)]
    )
    for out in results:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
