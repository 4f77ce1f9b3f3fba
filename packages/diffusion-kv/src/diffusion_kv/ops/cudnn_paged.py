"""Paged attention through cuDNN's own paged SDPA: the cache's pages read in place through the block tables.

cuDNN (9.5 and later, reached through the `nvidia-cudnn-frontend` package, extra `diffusion-kv[cudnn]`) runs
its fused attention with K and V given as page pools plus page tables. diffusion_kv's cache
`[num_blocks, 2, page, kv_heads, head_size]` already is such a pool: K is the view `kv_cache[:, 0]`, described
to cuDNN as `[num_blocks, kv_heads, page, head_size]` with strides `(2 * page * kv_heads * head_size, head_size,
kv_heads * head_size, 1)`, V the same view one half-block further, and every row's block-table row is its page
table. Nothing is gathered or copied: queries and outputs are the packed token axis, described as ragged
`[rows, heads, max_query_len, head_size]` tensors whose row starts are `query_start_loc` times the token stride
(queries may be views of a packed QKV tensor; outputs are contiguous).

One cuDNN graph is built per call shape (rows, heads, kv heads, head size, page, pool size, table width, the
longest query and key rows, query token stride, dtype, scale) and cached for the process (the
`MAX_CACHED_GRAPHS` most recently used). Per-row lengths are device tensors read by the kernel, so any forward whose
longest rows match reuses the graph. Building one costs about 45 ms (H200, 2026-12-01; a cached call 0.2-0.5 ms of host
and device time), so a serving loop should keep its row shapes few (a fixed prompt length does). The heuristic's first
plan runs; with `AUTOTUNE` set, every plan cuDNN builds is timed on a graph's first call and the fastest kept (on the
H200 no plan beat the heuristic's, 2026-12-01). Calls are captured by CUDA graphs like any other kernel launch: the
workspace comes from torch's allocator on the current stream, and nothing synchronizes.

It declines (`unsupported_reason` says why) what it cannot compute exactly: a query inside its row's causal
prefix (cuDNN's masks are bands, not diffusion_kv's prefix rule), fp32 or FP8 caches, head sizes cuDNN's fused
kernel lacks, a GPU older than sm80, metadata without host row shapes, or a missing cuDNN frontend.
Inputs are assumed validated by `diffusion_kv.ops`.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata, unmasked_rows_reason

_DTYPES = (torch.float16, torch.bfloat16)
MIN_CUDNN_BACKEND = 90500  # paged K/V in cuDNN's SDPA arrived in 9.5.0
AUTOTUNE = False  # True: time every plan cuDNN builds on a graph's first call and keep the fastest
_AUTOTUNE_REPEATS = 5


def _frontend() -> Any:
    import cudnn  # noqa: PLC0415 - optional dependency, imported on first use

    return cudnn


@functools.cache
def frontend_missing_reason() -> str | None:
    """None when the cuDNN frontend imports and its backend is new enough, else why not."""
    try:
        cudnn = _frontend()
    except ImportError as exc:
        return f"the cuDNN frontend is not installed (pip install 'diffusion-kv[cudnn]'): {exc}"
    try:
        version = int(cudnn.backend_version())
    except Exception as exc:  # noqa: BLE001 - a backend that fails to load is a reason, not a crash
        return f"the cuDNN backend did not load: {type(exc).__name__}: {exc}"
    if version < MIN_CUDNN_BACKEND:
        return f"cuDNN {version} is older than 9.5.0 (paged K/V needs 9.5+)"
    return None


def unsupported_reason(query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> str | None:
    """None when cuDNN's paged SDPA computes exactly what the reference does for the call, else the reason."""
    if not query.is_cuda:
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return "cuDNN's fused attention needs compute capability 8.0+"
    if kv_cache.dtype not in _DTYPES or query.dtype != kv_cache.dtype:
        return f"dtype {kv_cache.dtype} (fp16/bf16 caches only; FP8 goes through diffusion_kv.ops.fp8_attention)"
    head_size = kv_cache.shape[4]
    if head_size % 8 or head_size > 256:
        return f"head_size {head_size} (cuDNN needs a multiple of 8, at most 256)"
    if not kv_cache.is_contiguous():
        return "the cache is not contiguous"
    if query.stride(2) != 1 or query.stride(1) != head_size or query.stride(0) < query.shape[1] * head_size:
        return "query heads are not packed rows [tokens, heads, head_size] (a token stride may be wider)"
    if (query.stride(0) * query.element_size()) % 16 or query.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "a query token stride or a base pointer is not 16-byte aligned"
    return unmasked_rows_reason(metadata) or frontend_missing_reason()


@dataclass(frozen=True)
class _GraphKey:
    device: int
    dtype: torch.dtype
    rows: int
    heads: int
    kv_heads: int
    head_size: int
    page: int
    num_blocks: int
    table_pages: int
    table_row_stride: int
    max_query_len: int
    max_seq_len: int
    scale: float
    query_token_stride: int


@dataclass
class _Graph:
    graph: Any
    tensors: dict[str, Any]
    workspace_bytes: int
    plan_index: int | None


MAX_CACHED_GRAPHS = 64  # least recently used graphs beyond this are dropped (each holds built cuDNN plans)
_graphs: OrderedDict[_GraphKey, _Graph] = OrderedDict()
_handles: dict[int, Any] = {}
_row_tensors: tuple[weakref.ref, int, dict[str, Tensor]] | None = None


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(device: torch.device) -> Any:
    index = _device_index(device)
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = _frontend().create_handle()
    return _handles[index]


def _row_inputs(metadata: PagedAttentionMetadata, q_stride: int, o_stride: int) -> dict[str, Tensor]:
    """Per-row device tensors cuDNN reads (lengths, ragged element offsets), made once per forward's metadata.

    Offsets are int32 when every element offset fits, else int64 (``_offset_dtype``).
    """
    global _row_tensors
    strides = (q_stride, o_stride)
    if _row_tensors is not None and _row_tensors[0]() is metadata and _row_tensors[1] == strides:
        return _row_tensors[2]
    rows = metadata.num_rows
    starts = metadata.query_start_loc.to(torch.int64)
    offset_dtype = _offset_dtype(metadata, q_stride, o_stride)
    inputs = {
        "seq_len_q": (starts[1:] - starts[:-1]).to(torch.int32).view(rows, 1, 1, 1),
        "seq_len_kv": metadata.seq_lens.view(rows, 1, 1, 1),
        "ragged_q": (starts * q_stride).to(offset_dtype).view(rows + 1, 1, 1, 1),
        "ragged_o": (starts * o_stride).to(offset_dtype).view(rows + 1, 1, 1, 1),
        "table": metadata.block_tables,
    }
    _row_tensors = (weakref.ref(metadata), strides, inputs)
    return inputs


def _offset_dtype(metadata: PagedAttentionMetadata, q_stride: int, o_stride: int) -> torch.dtype:
    return torch.int32 if metadata.num_tokens * max(q_stride, o_stride) < 2**31 else torch.int64


def _data_type(cudnn: Any, dtype: torch.dtype) -> Any:
    return {
        torch.float16: cudnn.data_type.HALF,
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.int32: cudnn.data_type.INT32,
        torch.int64: cudnn.data_type.INT64,
    }[dtype]


def _build(key: _GraphKey, offset_dtype: torch.dtype, handle: Any) -> _Graph:
    cudnn = _frontend()
    io = _data_type(cudnn, key.dtype)
    graph = cudnn.pygraph(
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    h, hk, d, r = key.heads, key.kv_heads, key.head_size, key.rows
    token_q, token_o = key.query_token_stride, h * d
    index = _data_type(cudnn, torch.int32)
    ragged_q, ragged_o = (
        graph.tensor(name=name, dim=[r + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=_data_type(cudnn, offset_dtype))
        for name in ("ragged_q", "ragged_o")
    )
    q = graph.tensor(
        name="q",
        dim=[r, h, key.max_query_len, d],
        stride=[key.max_query_len * token_q, d, token_q, 1],
        data_type=io,
        ragged_offset=ragged_q,
    )
    pool_dims = [key.num_blocks, hk, key.page, d]
    pool_strides = [2 * key.page * hk * d, d, hk * d, 1]
    k = graph.tensor(name="k_pool", dim=pool_dims, stride=pool_strides, data_type=io)
    v = graph.tensor(name="v_pool", dim=pool_dims, stride=pool_strides, data_type=io)
    # cuDNN wants exactly ceil(max_seq_len / page) table columns: the first ones of each row, at the row stride.
    table_dims = [r, 1, key.table_pages, 1]
    table_strides = [key.table_row_stride, key.table_row_stride, 1, 1]
    k_table = graph.tensor(name="k_table", dim=table_dims, stride=table_strides, data_type=index)
    v_table = graph.tensor(name="v_table", dim=table_dims, stride=table_strides, data_type=index)
    seq_q = graph.tensor(name="seq_len_q", dim=[r, 1, 1, 1], stride=[1, 1, 1, 1], data_type=index)
    seq_kv = graph.tensor(name="seq_len_kv", dim=[r, 1, 1, 1], stride=[1, 1, 1, 1], data_type=index)
    o, _ = graph.sdpa(
        name="paged_sdpa",
        q=q,
        k=k,
        v=v,
        generate_stats=False,
        attn_scale=key.scale,
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_kv,
        paged_attention_k_table=k_table,
        paged_attention_v_table=v_table,
        paged_attention_max_seq_len_kv=key.max_seq_len,
    )
    o.set_output(True).set_dim([r, h, key.max_query_len, d]).set_stride(
        [key.max_query_len * token_o, d, token_o, 1]
    ).set_ragged_offset(ragged_o)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL if AUTOTUNE else cudnn.build_plan_policy.HEURISTICS_CHOICE)
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "o": o,
        "k_table": k_table,
        "v_table": v_table,
        "seq_len_q": seq_q,
        "seq_len_kv": seq_kv,
        "ragged_q": ragged_q,
        "ragged_o": ragged_o,
    }
    return _Graph(graph, tensors, int(graph.get_workspace_size()), None if AUTOTUNE else 0)


def _variant_pack(entry: _Graph, query: Tensor, kv_cache: Tensor, out: Tensor, rows: dict[str, Tensor]) -> dict:
    t = entry.tensors
    half_block = kv_cache.shape[2] * kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.element_size()
    base = kv_cache.data_ptr()
    return {
        t["q"]: query.data_ptr(),
        t["o"]: out.data_ptr(),
        t["k"]: base,
        t["v"]: base + half_block,
        t["k_table"]: rows["table"].data_ptr(),
        t["v_table"]: rows["table"].data_ptr(),
        t["seq_len_q"]: rows["seq_len_q"].data_ptr(),
        t["seq_len_kv"]: rows["seq_len_kv"].data_ptr(),
        t["ragged_q"]: rows["ragged_q"].data_ptr(),
        t["ragged_o"]: rows["ragged_o"].data_ptr(),
    }


def _pick_plan(entry: _Graph, pack: dict, device: torch.device, handle: Any) -> None:
    """Time every plan that built on this call's data (CUDA events, best of a few runs); keep the fastest."""
    best, best_ms, best_workspace = 0, float("inf"), entry.workspace_bytes
    for index in range(entry.graph.get_execution_plan_count()):
        try:
            size = int(entry.graph.get_workspace_size_plan_at_index(index))
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
            entry.graph.execute_plan_at_index(pack, workspace, index, handle=handle)
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a plan that did not build or cannot run this call is skipped
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(_AUTOTUNE_REPEATS):
            start.record()
            entry.graph.execute_plan_at_index(pack, workspace, index, handle=handle)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        if min(times) < best_ms:
            best, best_ms, best_workspace = index, min(times), size
    entry.plan_index, entry.workspace_bytes = best, best_workspace


def paged_attention(
    query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, scale: float, out: Tensor | None
) -> Tensor:
    """Attention of every row, into `out` when given (else a new tensor); call only when `unsupported_reason`
    returned None."""
    max_seq_len = metadata.host_max_seq_len
    assert max_seq_len is not None, "host_rows checked by unsupported_reason"
    num_blocks, _, page, kv_heads, head_size = kv_cache.shape
    heads = query.shape[1]
    if out is not None and out.is_contiguous():
        result = out
    else:
        result = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key = _GraphKey(
        device=_device_index(query.device),
        dtype=query.dtype,
        rows=metadata.num_rows,
        heads=heads,
        kv_heads=kv_heads,
        head_size=head_size,
        page=page,
        num_blocks=num_blocks,
        table_pages=-(-max_seq_len // page),
        table_row_stride=metadata.block_tables.stride(0),
        max_query_len=metadata.max_query_len,
        max_seq_len=max_seq_len,
        scale=float(scale),
        query_token_stride=query.stride(0),
    )
    rows = _row_inputs(metadata, query.stride(0), heads * head_size)
    handle = _handle(query.device)
    cudnn = _frontend()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(query.device).cuda_stream)
    entry = _graphs.get(key)
    if entry is None:
        entry = _graphs[key] = _build(key, rows["ragged_q"].dtype, handle)
        while len(_graphs) > MAX_CACHED_GRAPHS:
            _graphs.popitem(last=False)
    else:
        _graphs.move_to_end(key)
    pack = _variant_pack(entry, query, kv_cache, result, rows)
    if entry.plan_index is None and not torch.cuda.is_current_stream_capturing():  # timing needs synchronizing
        _pick_plan(entry, pack, query.device, handle)
    workspace = torch.empty(max(entry.workspace_bytes, 1), dtype=torch.uint8, device=query.device)
    with torch.cuda.device(query.device):  # the handle's device, whatever device is current
        entry.graph.execute_plan_at_index(pack, workspace, entry.plan_index or 0, handle=handle)
    if out is None:
        return result
    if result is not out:
        out.copy_(result)
    return out


__all__ = ["frontend_missing_reason", "paged_attention", "unsupported_reason"]
