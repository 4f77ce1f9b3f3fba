"""Triton paged K/V kernels against the torch reference and SDPA.

Without CUDA the kernels run on CPU tensors under the Triton interpreter: the env var
must be set before `diffusion_kv.ops.triton_kernels` is imported (Triton decides at
`@triton.jit` time), which is why it is set here at import. With CUDA they run natively.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_kernels = pytest.importorskip("diffusion_kv.ops.triton_kernels")

from kv_builders import as_i32, build_paged_rows, packed_qkv, row_metadata, sdpa_row  # noqa: E402

from diffusion_kv import PagedAttentionMetadata, paged_attention, write_kv_cache  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if ON_CUDA else "cpu"


def test_kernels_run_where_this_module_expects():
    assert ON_CUDA or triton_kernels.INTERPRETED, (
        "diffusion_kv.ops.triton_kernels was imported before TRITON_INTERPRET=1 was set; run this module first "
        "or export TRITON_INTERPRET=1"
    )


i32 = functools.partial(as_i32, device=DEVICE)


def test_write_kernel_matches_reference_on_packed_views():
    gen = torch.Generator().manual_seed(3)
    _, k, v = packed_qkv(9, 2, 2, 24, torch.float16, DEVICE, gen)
    slots = torch.tensor([5, 6, -1, 0, 31, 12, -1, 7, 20], device=DEVICE)
    metadata = PagedAttentionMetadata(
        block_tables=i32([[0]]),
        query_start_loc=i32([0, 9]),
        seq_lens=i32([9]),
        query_pos_start=i32([0]),
        slot_mapping=slots,
        causal_prefix_lens=None,
        block_size=8,
        num_tokens=9,
        max_query_len=9,
    )
    caches = []
    for backend in ("triton", "torch"):
        cache = torch.full((4, 2, 8, 2, 24), 7.0, dtype=torch.float16, device=DEVICE)
        write_kv_cache(k, v, cache, metadata, backend=backend)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert bool((caches[0] == 7.0).all(dim=(-1, -2)).sum() == 2 * 32 - 2 * 7)


@pytest.mark.parametrize("role", ["primary", "ar_decode"])
def test_seed_case_matches_sdpa(role):
    """fp16, 2 heads x 64, block 16, blocks [3, 1]: 17-token prefix, then a 2-token suffix over 19 keys.

    At the op level a role is just which cache tensor the row lives in; each role gets its own.
    """
    gen = torch.Generator().manual_seed(0 if role == "primary" else 1)
    caches = {r: torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16, device=DEVICE) for r in ("primary", "ar_decode")}
    q, k, v = packed_qkv(19, 2, 2, 64, torch.float16, DEVICE, gen)
    cache = caches[role]
    prefix = row_metadata([[3, 1]], [(0, 17)], 16, DEVICE)
    write_kv_cache(k[:17], v[:17], cache, prefix, backend="triton")
    out = paged_attention(q[:17], cache, prefix, backend="triton")
    torch.testing.assert_close(out.float(), sdpa_row(q[:17], k[:17], v[:17]), rtol=2e-2, atol=2e-2)
    suffix = row_metadata([[3, 1]], [(17, 2)], 16, DEVICE)
    write_kv_cache(k[17:], v[17:], cache, suffix, backend="triton")
    out = paged_attention(q[17:], cache, suffix, backend="triton")
    torch.testing.assert_close(out.float(), sdpa_row(q[17:], k, v), rtol=2e-2, atol=2e-2)
    other = "ar_decode" if role == "primary" else "primary"
    assert not caches[other].any()


@pytest.mark.parametrize(
    "page_size,num_heads,num_kv_heads,head_size,dtype",
    [
        (8, 4, 4, 32, torch.float16),  # tiles span pages (per-key block ids)
        (32, 6, 2, 32, torch.bfloat16),  # tiles inside a page (one block id per tile), GQA
        (16, 2, 1, 24, torch.float32),  # head size not a power of two, fp32 exact dots
        (12, 4, 2, 32, torch.float16),  # page size not a power of two: per-key lookups
        (48, 4, 1, 32, torch.float16),  # page a multiple of the tile but not a power of two
    ],
)
def test_ragged_batch_matches_sdpa(page_size, num_heads, num_kv_heads, head_size, dtype):
    rows = [(0, 21), (35, 3), (9, 16)]
    args, queries, dense = build_paged_rows(
        rows, num_heads, num_kv_heads, head_size, page_size, dtype, seed=4, device=DEVICE, backend="triton"
    )
    out = paged_attention(*args, backend="triton")
    expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    reference = paged_attention(*args, backend="torch")
    torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol)


def test_causal_prefix_mask_matches_sdpa():
    """Row 0: prefix 20 of 40 with queries spanning prefix and target; row 1: target-only queries."""
    rows = [(0, 40), (30, 7)]
    prefix_lens = [20, 12]
    args, queries, dense = build_paged_rows(
        rows, 4, 2, 32, 8, torch.float16, seed=5, device=DEVICE, backend="triton", causal_prefix_lens=prefix_lens
    )
    out = paged_attention(*args, scale=0.2, backend="triton")
    expected = []
    for (start, n), prefix, q, (k, v) in zip(rows, prefix_lens, queries, dense, strict=True):
        pos = torch.arange(start, start + n)[:, None]
        keys = torch.arange(k.shape[0])[None, :]
        mask = ((pos >= prefix) | (keys <= pos)).to(DEVICE)
        expected.append(sdpa_row(q, k, v, mask=mask, scale=0.2))
    torch.testing.assert_close(out.float(), torch.cat(expected), rtol=2e-2, atol=2e-2)


def test_strided_out_is_filled():
    args, queries, dense = build_paged_rows(
        [(0, 5)], 2, 2, 16, 4, torch.float16, seed=6, device=DEVICE, backend="triton"
    )
    storage = torch.zeros(5, 2, 32, dtype=torch.float16, device=DEVICE)
    out = storage[..., ::2]
    result = paged_attention(*args, out=out, backend="triton")
    assert result is out
    torch.testing.assert_close(out.float(), sdpa_row(queries[0], *dense[0]), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not ON_CUDA, reason="the autotuned launch exists only for compiled (CUDA) kernels")
@pytest.mark.parametrize("page_size", [16, 256])
def test_autotuned_launch_matches_sdpa(page_size):
    """A query span long enough to take the autotuned path (>= AUTOTUNE_MIN_QUERY_LEN queries)."""
    n = triton_kernels.AUTOTUNE_MIN_QUERY_LEN + 77
    rows = [(0, n), (40, n - 40)]
    args, queries, dense = build_paged_rows(
        rows, 4, 2, 128, page_size, torch.bfloat16, seed=7, device=DEVICE, backend="triton"
    )
    out = paged_attention(*args, backend="triton")
    expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
