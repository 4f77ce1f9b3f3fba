"""Paged K/V ops (torch path, and the Triton path on CUDA when present) against dense SDPA."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import paged_attention, write_kv_cache
from kv_builders import as_i32, build_paged_rows, packed_qkv, sdpa_row

BACKENDS = ["torch"] + (["triton"] if torch.cuda.is_available() else [])
DEVICE = {"torch": "cpu", "triton": "cuda"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_case_prefix_then_suffix_matches_sdpa(backend):
    """fp16, 2 heads x 64, block 16, blocks [3, 1]: a 17-token prefix forward, then a 2-token suffix."""
    device = DEVICE[backend]
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16, device=device)
    block_tables = as_i32([[3, 1]], device)
    q, k, v = packed_qkv(19, 2, 2, 64, torch.float16, device, gen)
    assert not k.is_contiguous() and not v.is_contiguous()

    prefix_slots = torch.tensor(list(range(48, 64)) + [16], dtype=torch.int64, device=device)
    write_kv_cache(k[:17], v[:17], kv_cache, prefix_slots, backend=backend)
    out = paged_attention(
        q[:17], kv_cache, block_tables, as_i32([0, 17], device), as_i32([17], device), as_i32([0], device),
        backend=backend,
    )
    torch.testing.assert_close(out.float(), sdpa_row(q[:17], k[:17], v[:17]), rtol=2e-2, atol=2e-2)

    before = kv_cache.clone()
    suffix_slots = torch.tensor([17, 18], dtype=torch.int64, device=device)
    write_kv_cache(k[17:], v[17:], kv_cache, suffix_slots, backend=backend)
    changed = (kv_cache != before).flatten(3).any(-1)  # [block, kv, offset]
    assert changed.nonzero().tolist() == [[1, 0, 1], [1, 0, 2], [1, 1, 1], [1, 1, 2]]
    out = paged_attention(
        q[17:], kv_cache, block_tables, as_i32([0, 2], device), as_i32([19], device), as_i32([17], device),
        backend=backend,
    )
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
    expected = [sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense)]
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
    write_kv_cache(k, v, kv_cache, (torch.tensor(ids)[pos // block_size] * block_size + pos % block_size).to(device),
                   backend=backend)
    out = paged_attention(
        q, kv_cache, as_i32([ids], device), as_i32([0, total], device), as_i32([total], device), as_i32([0], device),
        scale=0.3, causal_prefix_lens=as_i32([prefix], device), backend=backend,
    )
    allowed = (pos[:, None] >= prefix) | (pos[None, :] <= pos[:, None])
    ref = sdpa_row(q, k, v, mask=allowed.to(device), scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # The mask matters: the same call without it differs for the prefix queries only.
    plain = paged_attention(
        q, kv_cache, as_i32([ids], device), as_i32([0, total], device), as_i32([total], device), as_i32([0], device),
        scale=0.3, backend=backend,
    )
    assert not torch.allclose(plain[: prefix - 1], out[: prefix - 1], atol=1e-3)
    torch.testing.assert_close(plain[prefix:], out[prefix:], rtol=1e-5, atol=1e-5)


def test_negative_slots_are_skipped():
    kv_cache = torch.zeros(2, 2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    write_kv_cache(key, -key, kv_cache, torch.tensor([5, -1, 0]))
    assert kv_cache[1, 0, 1].eq(1).all() and kv_cache[0, 1, 0].eq(-1).all()
    assert int((kv_cache != 0).flatten(3).any(-1).sum()) == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"key": torch.ones(3, 2, 8)}, "key must have shape"),
        ({"value": torch.ones(3, 1, 8, dtype=torch.float16)}, "value dtype"),
        ({"slot_mapping": torch.tensor([0, 1])}, "one slot per token"),
        ({"slot_mapping": torch.tensor([0, 1, 8])}, "beyond the pool's 8 slots"),
        ({"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, "int64"),
        ({"kv_cache": torch.zeros(2, 3, 4, 1, 8)}, "kv_cache must have shape"),
    ],
)
def test_write_rejects_bad_inputs_and_changes_nothing(kwargs, match):
    args = {
        "key": torch.ones(3, 1, 8),
        "value": torch.ones(3, 1, 8),
        "kv_cache": torch.zeros(2, 2, 4, 1, 8),
        "slot_mapping": torch.tensor([0, 1, 2]),
    }
    args.update(kwargs)
    snapshot = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)
    assert torch.equal(args["kv_cache"], snapshot)


def _attention_args():
    return {
        "query": torch.randn(5, 4, 8),
        "kv_cache": torch.zeros(4, 2, 4, 2, 8),
        "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 5], dtype=torch.int32),
        "seq_lens": torch.tensor([3, 8], dtype=torch.int32),
        "query_pos_start": torch.tensor([0, 6], dtype=torch.int32),
    }


@pytest.mark.parametrize(
    "update,match",
    [
        ({"query": torch.randn(5, 3, 8)}, "multiple of the cache's num_kv_heads"),
        ({"query": torch.randn(5, 4, 8, dtype=torch.float16)}, "query dtype"),
        ({"seq_lens": torch.tensor([3, 7], dtype=torch.int32)}, "beyond seq_len=7"),
        ({"seq_lens": torch.tensor([3, 9], dtype=torch.int32), "query_pos_start": torch.tensor([0, 7], dtype=torch.int32)},
         "exceeds the block table width"),
        ({"block_tables": torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)}, r"must lie in \[0, 4\)"),
        ({"query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32)}, "end at total_q=5"),
        ({"seq_lens": torch.tensor([3], dtype=torch.int32)}, r"shape \[2\] for 2 rows"),
        ({"out": torch.empty(5, 4, 4)}, "out must match query"),
    ],
)
def test_attention_rejects_bad_inputs(update, match):
    args = _attention_args()
    args.update(update)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(**_attention_args(), backend="cuda")
