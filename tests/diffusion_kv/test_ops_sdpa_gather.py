"""The gather + SDPA attention path (`backend="sdpa"`, and `"auto"` on CUDA for long rows) against dense SDPA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_builders import build_paged_rows, packed_qkv, row_metadata, sdpa_row

from diffusion_kv import paged_attention, write_kv_cache
from diffusion_kv.ops import SDPA_GATHER_MIN_QUERY_LEN, sdpa_gather

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WRITE = {"cpu": "torch", "cuda": "triton"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ragged_rows_match_sdpa(device, dtype):
    """Two CFG-like twins (adjacent, same shape: one SDPA call), then rows of other shapes, over a shuffled pool."""
    rows = [(0, 24), (0, 24), (20, 5), (3, 30), (3, 30)]  # (query_pos_start, num_queries)
    args, queries, dense = build_paged_rows(
        rows, 4, 4, 32, 8, dtype, seed=3, device=device, backend=WRITE[device], spare_blocks=3
    )
    assert sdpa_gather._runs(args[2].host_rows) == [(0, 2), (2, 3), (3, 5)]
    expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=device)
    result = paged_attention(*args, out=out, backend="sdpa")
    assert result is out and not out.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    reference = paged_attention(*args, backend="torch")
    torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)
    fresh = paged_attention(*args, backend="sdpa")  # no `out`: three runs fill a new tensor
    assert fresh.shape == out.shape and fresh.is_contiguous()
    torch.testing.assert_close(fresh, out, rtol=0, atol=0)
    twins = dataclasses.replace(
        args[2],
        host_rows=args[2].host_rows[:2],
        block_tables=args[2].block_tables[:2],
        query_start_loc=args[2].query_start_loc[:3],
        seq_lens=args[2].seq_lens[:2],
        query_pos_start=args[2].query_pos_start[:2],
        slot_mapping=args[2].slot_mapping[:48],
        num_tokens=48,
        max_query_len=24,
    )
    single = paged_attention(args[0][:48], args[1], twins, backend="sdpa")  # one run over every token: SDPA's own
    assert single.is_contiguous()
    torch.testing.assert_close(single, out[:48], rtol=0, atol=0)


def test_packed_queries_scale_and_empty_rows():
    """Queries as views of a packed QKV tensor, a custom scale, and a row with no queries in the middle."""
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.zeros(8, 2, 4, 2, 16)
    q, k, v = packed_qkv(10, 2, 2, 16, torch.float32, "cpu", gen)
    assert not q.is_contiguous()
    write_kv_cache(k, v, kv_cache, row_metadata([[6, 1, 4]], [(0, 10)], 4, "cpu"))
    metadata = row_metadata([[6, 1, 4], [6, 1, 4]], [(0, 10), (10, 0)], 4, "cpu")
    out = paged_attention(q, kv_cache, metadata, scale=0.2, backend="sdpa")
    torch.testing.assert_close(out, sdpa_row(q, k, v, scale=0.2), rtol=1e-5, atol=1e-5)


def test_queries_past_the_causal_prefix_run_and_queries_inside_it_are_declined():
    rows = [(6, 10), (6, 10)]  # every query after a 6-token causal prefix: attends to all keys
    args, queries, dense = build_paged_rows(
        rows, 2, 2, 16, 4, torch.float32, seed=7, device="cpu", backend="torch", causal_prefix_lens=[6, 6]
    )
    out = paged_attention(*args, backend="sdpa")
    torch.testing.assert_close(
        out, torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)]), rtol=1e-5, atol=1e-5
    )
    inside, *_ = build_paged_rows(
        [(0, 16)], 2, 2, 16, 4, torch.float32, seed=7, device="cpu", backend="torch", causal_prefix_lens=[6]
    )
    assert sdpa_gather.unsupported_reason(*inside) == "a query lies inside its row's causal prefix"
    out = torch.zeros_like(inside[0])
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call: a query lies inside"):
        paged_attention(*inside, out=out, backend="sdpa")
    assert not out.any()  # refused before anything was written


def test_unsupported_calls_say_why():
    args, *_ = build_paged_rows([(0, 8)], 4, 2, 16, 4, torch.float32, seed=1, device="cpu", backend="torch")
    assert sdpa_gather.unsupported_reason(*args).startswith("grouped-query heads (4 query heads over 2 kv heads)")
    args, *_ = build_paged_rows([(0, 8)], 2, 2, 16, 4, torch.float32, seed=1, device="cpu", backend="torch")
    bare = dataclasses.replace(args[2], host_rows=None)
    assert "no host row shapes" in sdpa_gather.unsupported_reason(args[0], args[1], bare)
    with pytest.raises(ValueError, match="host_rows has 2 entries for 1 block-table rows"):
        dataclasses.replace(args[2], host_rows=args[2].host_rows * 2)
    with pytest.raises(ValueError, match="write_kv_cache takes 'auto', 'torch' or 'triton'"):
        write_kv_cache(args[0], args[0], args[1], row_metadata([[0, 1]], [(0, 8)], 4, "cpu"), backend="sdpa")


def test_auto_keeps_the_reference_path_on_cpu_and_the_threshold_is_public():
    assert SDPA_GATHER_MIN_QUERY_LEN == 512
    args, *_ = build_paged_rows([(0, 8)], 2, 2, 16, 4, torch.float32, seed=2, device="cpu", backend="torch")
    torch.testing.assert_close(paged_attention(*args), paged_attention(*args, backend="torch"), rtol=0, atol=0)


def test_per_forward_row_facts_are_computed_from_host_rows_once():
    """The launch decisions every layer makes (longest row, causal-prefix queries) come from one cached pass."""
    _, _, metadata = build_paged_rows(
        [(0, 8), (6, 10)], 2, 2, 16, 4, torch.float32, seed=1, device="cpu", backend="torch", causal_prefix_lens=[0, 6]
    )[0]
    assert metadata.host_max_seq_len == 16 and metadata.queries_inside_causal_prefix is False
    assert "host_max_seq_len" in vars(metadata)  # cached on the instance: later layers do not re-walk the rows
    _, _, inside = build_paged_rows(
        [(0, 8)], 2, 2, 16, 4, torch.float32, seed=1, device="cpu", backend="torch", causal_prefix_lens=[3]
    )[0]
    assert inside.queries_inside_causal_prefix is True
    bare = dataclasses.replace(metadata, host_rows=None)
    assert bare.host_max_seq_len is None and bare.queries_inside_causal_prefix is None
