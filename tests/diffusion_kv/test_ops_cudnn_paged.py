"""cuDNN's paged SDPA (`backend="cudnn"`, and `"auto"` on CUDA for long-query rows of at most 4096 keys).

On a CUDA machine with `nvidia-cudnn-frontend` installed the kernel runs against SDPA and the torch reference.
Everywhere, the refusals run: CPU tensors, the write op, and (without the frontend) the install hint.
"""

from __future__ import annotations

import pytest
import torch
from kv_builders import build_paged_rows, row_metadata, sdpa_row

from diffusion_kv import PagedAttentionMetadata, paged_attention, write_kv_cache
from diffusion_kv.ops import CUDNN_PAGED_MAX_SEQ_LEN, _library_order, cudnn_paged, sdpa_gather

ON_CUDA = torch.cuda.is_available()
FRONTEND_REASON = cudnn_paged.frontend_missing_reason() if ON_CUDA else "no CUDA device"
needs_cudnn = pytest.mark.skipif(
    not ON_CUDA or FRONTEND_REASON is not None, reason=f"cuDNN's paged SDPA cannot run here: {FRONTEND_REASON}"
)


def test_cpu_calls_are_refused_before_anything_is_written():
    args, *_ = build_paged_rows([(0, 8)], 2, 2, 16, 4, torch.float32, seed=1, device="cpu", backend="torch")
    assert cudnn_paged.unsupported_reason(*args) == "not a CUDA tensor"
    out = torch.zeros_like(args[0])
    with pytest.raises(ValueError, match="backend='cudnn' cannot run this call: not a CUDA tensor; use backend='auto'"):
        paged_attention(*args, out=out, backend="cudnn")
    assert not out.any()
    with pytest.raises(ValueError, match="backend='cudnn' is an attention backend only"):
        write_kv_cache(args[0], args[0], args[1], row_metadata([[0, 1]], [(0, 8)], 4, "cpu"), backend="cudnn")


def test_a_missing_frontend_names_the_extra_to_install():
    try:
        import cudnn  # noqa: F401
    except ImportError:
        reason = cudnn_paged.frontend_missing_reason()
        assert reason is not None and "pip install 'diffusion-kv[cudnn]'" in reason
    else:
        pytest.skip("nvidia-cudnn-frontend is installed here")


@pytest.mark.parametrize(
    "longest,first", [(CUDNN_PAGED_MAX_SEQ_LEN, cudnn_paged), (CUDNN_PAGED_MAX_SEQ_LEN + 1, sdpa_gather)]
)
def test_auto_prefers_cudnn_up_to_the_key_threshold_and_gather_beyond(longest, first):
    metadata = PagedAttentionMetadata.build(
        torch.zeros(2, longest, dtype=torch.int32),
        block_size=1,
        query_lens=[1, 1],
        seq_lens=[3, longest],
        query_pos_start=[2, longest - 1],
    )
    order = _library_order(metadata)
    assert order[0] is first and set(order) == {cudnn_paged, sdpa_gather}


def _run(args, scale=None):
    query, kv_cache, metadata = args
    assert cudnn_paged.unsupported_reason(query, kv_cache, metadata) is None
    out = torch.full_like(query, float("nan"))
    result = paged_attention(query, kv_cache, metadata, scale=scale, out=out, backend="cudnn")
    assert result is out and not out.isnan().any()
    return out


@needs_cudnn
@pytest.mark.parametrize(
    "rows,heads,kv_heads,head_size,page,dtype",
    [
        ([(0, 300), (0, 300), (40, 77), (5, 513)], 8, 8, 128, 64, torch.bfloat16),  # ragged rows, CFG-like twins
        ([(0, 200), (10, 64)], 8, 2, 64, 64, torch.float16),  # GQA
        ([(0, 128), (0, 256)], 4, 4, 256, 64, torch.bfloat16),  # head size 256
        ([(0, 100), (9, 31)], 4, 4, 80, 16, torch.bfloat16),  # head size 80, pages of 16
        ([(0, 128), (0, 0), (3, 60)], 4, 4, 128, 64, torch.bfloat16),  # a row with no queries
    ],
)
def test_rows_match_sdpa(rows, heads, kv_heads, head_size, page, dtype):
    args, queries, dense = build_paged_rows(
        rows, heads, kv_heads, head_size, page, dtype, seed=11, device="cuda", backend="triton", spare_blocks=5
    )
    out = _run(args)
    expected = torch.cat([sdpa_row(q, k, v) for q, (k, v) in zip(queries, dense, strict=True)])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    reference = paged_attention(*args, backend="torch")
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)


@needs_cudnn
def test_queries_as_views_of_packed_qkv_and_a_custom_scale():
    args, *_ = build_paged_rows(
        [(0, 96), (32, 64)], 4, 4, 128, 64, torch.bfloat16, seed=2, device="cuda", backend="triton"
    )
    query, kv_cache, metadata = args
    packed = torch.randn(query.shape[0], 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    packed[:, 0] = query
    view = packed[:, 0]
    assert view.stride(0) == 3 * 4 * 128
    out = _run((view, kv_cache, metadata), scale=0.05)
    expected = paged_attention(query, kv_cache, metadata, scale=0.05, backend="torch")
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@needs_cudnn
def test_cuda_graph_replay_reads_new_queries():
    args, *_ = build_paged_rows(
        [(0, 256), (0, 256)], 8, 8, 128, 64, torch.bfloat16, seed=3, device="cuda", backend="triton"
    )
    query, kv_cache, metadata = args
    out = torch.empty_like(query)
    paged_attention(query, kv_cache, metadata, out=out, backend="cudnn")  # builds the graph outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, kv_cache, metadata, out=out, backend="cudnn")
    query.copy_(torch.randn_like(query))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), paged_attention(*args, backend="torch").float(), rtol=2e-2, atol=2e-2)


@needs_cudnn
def test_declines_what_it_cannot_compute_exactly():
    inside, *_ = build_paged_rows(
        [(0, 64)], 2, 2, 64, 16, torch.bfloat16, seed=7, device="cuda", backend="triton", causal_prefix_lens=[6]
    )
    assert cudnn_paged.unsupported_reason(*inside) == "a query lies inside its row's causal prefix"
    fp32, *_ = build_paged_rows([(0, 8)], 2, 2, 64, 16, torch.float32, seed=7, device="cuda", backend="torch")
    assert cudnn_paged.unsupported_reason(*fp32).startswith("dtype torch.float32")
    out = torch.zeros_like(inside[0])
    with pytest.raises(ValueError, match="cannot run this call: a query lies inside"):
        paged_attention(*inside, out=out, backend="cudnn")
    assert not out.any()


@needs_cudnn
def test_auto_takes_cudnn_for_long_query_rows():
    args, *_ = build_paged_rows(
        [(512, 1024), (512, 1024)], 4, 4, 128, 64, torch.bfloat16, seed=9, device="cuda", backend="triton"
    )
    cudnn_paged._graphs.clear()
    out = paged_attention(*args)
    assert len(cudnn_paged._graphs) == 1  # the auto path built (and ran) a cuDNN graph
    torch.testing.assert_close(out.float(), paged_attention(*args, backend="torch").float(), rtol=2e-2, atol=2e-2)


@needs_cudnn
def test_the_graph_cache_keeps_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(cudnn_paged, "MAX_CACHED_GRAPHS", 2)
    cudnn_paged._graphs.clear()
    shapes = [[(0, 64)], [(0, 128)], [(0, 64)], [(0, 192)]]  # the third reuses the first's graph
    for rows in shapes:
        args, *_ = build_paged_rows(rows, 4, 4, 64, 64, torch.bfloat16, seed=4, device="cuda", backend="triton")
        out = _run(args)
        torch.testing.assert_close(out.float(), paged_attention(*args, backend="torch").float(), rtol=2e-2, atol=2e-2)
    assert [key.max_query_len for key in cudnn_paged._graphs] == [64, 192]
