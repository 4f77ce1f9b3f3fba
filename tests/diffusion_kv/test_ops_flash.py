"""The Hopper paged-attention kernels (triton_flash) and the FP8 attention ops, against SDPA and the references.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (key tiles of 16, head sizes 16/32);
with CUDA they run natively (key tiles of 64+, head sizes 64/128; the TMA kernel needs compute capability 9.0).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_flash = pytest.importorskip("diffusion_kv.ops.triton_flash")

from kv_builders import as_i32, build_paged_rows, row_metadata, sdpa_row  # noqa: E402

from diffusion_kv import PagedAttentionMetadata  # noqa: E402
from diffusion_kv.ops import fp8_attention  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if ON_CUDA else "cpu"
if ON_CUDA and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("the TMA kernels need compute capability 9.0+", allow_module_level=True)
PAGE = 64 if ON_CUDA else 16
HEAD = 64 if ON_CUDA else 32
i32 = functools.partial(as_i32, device=DEVICE)


def _flash(args, *, scale):
    query, kv_cache, metadata = args
    assert triton_flash.supported(query, kv_cache) is None
    out = torch.full_like(query, float("nan"))
    return triton_flash.paged_attention(query, kv_cache, metadata, scale, out)


@pytest.mark.parametrize(
    "page_mult,num_heads,num_kv_heads,dtype",
    [
        (1, 4, 4, torch.float16),
        (2, 6, 2, torch.bfloat16),  # GQA, a page of two key tiles
        (3, 4, 1, torch.float16),  # a page of three key tiles, one kv head
    ],
)
def test_ragged_rows_match_sdpa(page_mult, num_heads, num_kv_heads, dtype):
    rows = [(0, 3 * PAGE + 5), (PAGE + 3, 20), (7, 2 * PAGE)]
    args, queries, dense = build_paged_rows(
        rows, num_heads, num_kv_heads, HEAD, PAGE * page_mult, dtype, seed=4, device=DEVICE, backend="torch"
    )
    out = _flash(args, scale=HEAD**-0.5)
    expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_causal_prefix_matches_sdpa():
    """Row 0 spans prefix and target queries; row 1 holds only prefix queries; row 2 only target queries."""
    rows = [(0, 2 * PAGE + 9), (3, PAGE), (PAGE + 1, 17)]
    prefix_lens = [PAGE + 5, 2 * PAGE, 9]
    args, queries, dense = build_paged_rows(
        rows, 4, 2, HEAD, PAGE, torch.float16, seed=5, device=DEVICE, backend="torch", causal_prefix_lens=prefix_lens
    )
    out = _flash(args, scale=0.2)
    expected = []
    for (start, n), prefix, q, (k, v) in zip(rows, prefix_lens, queries, dense, strict=True):
        pos = torch.arange(start, start + n)[:, None]
        keys = torch.arange(k.shape[0])[None, :]
        expected.append(sdpa_row(q, k, v, mask=((pos >= prefix) | (keys <= pos)).to(DEVICE), scale=0.2))
    torch.testing.assert_close(out.float(), torch.cat(expected), rtol=2e-2, atol=2e-2)


def test_nan_in_unwritten_slots_never_reaches_the_output():
    """Slots past seq_len in the last page hold NaN: the masked tail tile must not read them into a dot."""
    rows = [(0, PAGE + 3)]
    args, queries, dense = build_paged_rows(
        rows, 2, 2, HEAD, PAGE, torch.float16, seed=6, device=DEVICE, backend="torch"
    )
    cache, tables = args[1], args[2].block_tables
    last = int(tables[0, 1])
    cache[last, :, 3:] = float("nan")
    out = _flash(args, scale=HEAD**-0.5)
    torch.testing.assert_close(out.float(), sdpa_row(queries[0], *dense[0]), rtol=2e-2, atol=2e-2)


def test_unsupported_calls_say_why():
    query = torch.zeros(4, 2, HEAD, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(2, 2, PAGE, 2, HEAD, dtype=torch.float16, device=DEVICE)
    assert triton_flash.supported(query, cache) is None
    assert "dtype" in triton_flash.supported(query.float(), cache.float())
    assert "page size" in triton_flash.supported(
        query, torch.zeros(2, 2, PAGE + 8, 2, HEAD, dtype=torch.float16, device=DEVICE)
    )
    assert "head_size" in triton_flash.supported(query[..., :24], cache[..., :24])
    spread = torch.zeros(4, 4, HEAD, dtype=torch.float16, device=DEVICE)[:, ::2]  # heads 2 * HEAD apart
    assert "query heads" in triton_flash.supported(spread, cache)


def test_the_public_op_runs_the_hopper_kernel_where_it_applies(monkeypatch):
    """paged_attention(backend='triton') dispatches to triton_flash when supported, to triton_kernels otherwise.

    Both kernels really run; the launchers are wrapped only to record which one the op called.
    """
    from diffusion_kv import paged_attention
    from diffusion_kv.ops import triton_kernels

    calls = []
    for module in (triton_flash, triton_kernels):
        launch = module.paged_attention
        monkeypatch.setattr(
            module,
            "paged_attention",
            lambda *a, _launch=launch, _name=module.__name__, **k: calls.append(_name) or _launch(*a, **k),
        )
    rows = [(0, PAGE + 9), (5, 17)]
    for dtype, kernel in ((torch.float16, "triton_flash"), (torch.float32, "triton_kernels")):
        args, queries, dense = build_paged_rows(rows, 4, 2, HEAD, PAGE, dtype, seed=10, device=DEVICE, backend="torch")
        out = paged_attention(*args, backend="triton")
        assert calls.pop().endswith(kernel) and not calls
        expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def _fp8_rows(rows, num_heads, num_kv_heads, seed):
    args, queries, dense = build_paged_rows(
        rows, num_heads, num_kv_heads, HEAD, PAGE, torch.bfloat16, seed=seed, device=DEVICE, backend="torch"
    )
    query, cache, metadata = args
    keys = torch.cat([k for k, _ in dense])
    values = torch.cat([v for _, v in dense])
    k_scale, v_scale = fp8_attention.per_head_scales(keys), fp8_attention.per_head_scales(values)
    q_scale = fp8_attention.per_head_scales(query)
    fp8_cache = torch.zeros(cache.shape, dtype=fp8_attention.FP8_DTYPE, device=DEVICE)
    for row, ((start, n), (k, v)) in enumerate(zip(rows, dense, strict=True)):
        whole_row = row_metadata([metadata.block_tables[row].tolist()], [(0, start + n)], PAGE, DEVICE)
        fp8_attention.write_kv_cache_fp8(k, v, fp8_cache, whole_row, k_scale, v_scale, backend="torch")
    q8 = fp8_attention.quantize_per_head(query, q_scale)
    return (q8, q_scale, fp8_cache, k_scale, v_scale, metadata), queries, dense


def test_fp8_attention_matches_its_reference_and_stays_near_bf16():
    rows = [(0, 2 * PAGE + 7), (5, PAGE)]
    args, queries, dense = _fp8_rows(rows, 4, 2, seed=7)
    got = fp8_attention.paged_attention_fp8(*args, backend="triton")
    ref = fp8_attention.paged_attention_fp8(*args, backend="torch")
    exact = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    # The kernel rounds the probabilities to e4m3 as well; the reference does not.
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 0.05
    assert ((ref.float() - exact).norm() / exact.norm()).item() < 0.15  # e4m3 Q/K/V on random data


def test_fp8_cache_write_kernel_matches_the_reference_on_exact_values():
    """Inputs that are e4m3 values times their head's scale: both writers must store the same bytes."""
    gen = torch.Generator().manual_seed(8)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8_attention.FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)]
    scales = torch.tensor([0.5, 2.0], device=DEVICE)
    k = grid[torch.randint(len(grid), (9, 2, HEAD), generator=gen)].to(DEVICE) * scales.view(1, 2, 1)
    v = grid[torch.randint(len(grid), (9, 2, HEAD), generator=gen)].to(DEVICE) * scales.view(1, 2, 1)
    slots = torch.tensor([0, 1, PAGE + 2, -1, 3, 2 * PAGE - 1, 5, PAGE, 7], device=DEVICE)
    metadata = PagedAttentionMetadata(  # the plain constructor takes the slot mapping as given
        block_tables=i32([[0, 1]]),
        query_start_loc=i32([0, 9]),
        seq_lens=i32([2 * PAGE]),
        query_pos_start=i32([0]),
        slot_mapping=slots,
        causal_prefix_lens=None,
        block_size=PAGE,
        num_tokens=9,
        max_query_len=9,
    )
    caches = []
    for backend in ("triton", "torch"):
        cache = torch.zeros(2, 2, PAGE, 2, HEAD, dtype=fp8_attention.FP8_DTYPE, device=DEVICE)
        fp8_attention.write_kv_cache_fp8(k, v, cache, metadata, scales, scales, backend=backend)
        caches.append(cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    deq = fp8_attention.dequantize_kv_cache_fp8(caches[1].view(fp8_attention.FP8_DTYPE), scales, scales)
    assert torch.equal(deq[1, 0, 2], k[2].float()) and torch.equal(deq[1, 1, PAGE - 1], v[5].float())


def test_fp8_inputs_are_validated():
    args, _, _ = _fp8_rows([(0, PAGE)], 2, 2, seed=9)
    q8, q_scale, cache, k_scale, v_scale, metadata = args
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_attention.paged_attention_fp8(q8.float(), *args[1:])
    with pytest.raises(ValueError, match="q_scale must be a float32"):
        fp8_attention.paged_attention_fp8(q8, q_scale[:1], *args[2:])
    with pytest.raises(ValueError, match="kv_cache must be a"):
        fp8_attention.paged_attention_fp8(q8, q_scale, cache.float(), *args[3:])
    causal = row_metadata(metadata.block_tables.tolist(), [(0, PAGE)], PAGE, DEVICE, causal_prefix_lens=[4])
    with pytest.raises(ValueError, match="non-causal"):
        fp8_attention.paged_attention_fp8(*args[:5], causal)
    with pytest.raises(ValueError, match="tokens but the metadata"):
        fp8_attention.paged_attention_fp8(q8[1:], *args[1:])
