"""Triton kernels for the paged K/V ops (CUDA; also runs under `TRITON_INTERPRET=1`).

`paged_attention` is a FlashAttention-style forward over a paged cache: each program
owns a tile of BLOCK_M queries of one (row, query head), walks the row's keys in
BLOCK_N steps, finds their physical pages through the row's block table, and keeps
an online softmax in fp32 (base-2 exponent, scale folded into the logits). GQA maps
query head h to kv head `h // (num_heads // num_kv_heads)`. When the page size is a
multiple of BLOCK_N a key tile lies inside one page (one block-table read per tile);
otherwise (small or odd page sizes) each key's page is looked up. The optional causal-prefix mask only costs work in
tiles that hold prefix queries; target-only tiles run unmasked except on the last,
partial key tile.

Inputs are validated by `diffusion_kv.ops` before they reach these launchers; the row metadata is
int32 (`PagedAttentionMetadata` enforces it), which keeps every branch of the kernel type-consistent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs

from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata

INTERPRETED: bool = bool(knobs.runtime.interpret)
MAX_HEAD_SIZE = 256  # a BLOCK_M x head_size fp32 accumulator beyond this does not fit in registers


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_co,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        dst = cache_ptr + block * stride_cb + offset * stride_co + heads * stride_ch + dims
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_ckv, v, mask=mask)


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata) -> None:
    """Launch one program per token; negative slots return without writing."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    _write_kv_kernel[(key.shape[0],)](
        key,
        value,
        kv_cache,
        metadata.slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
    )


@triton.jit
def _kv_tile_offsets(
    block_table_row_ptr,
    start_n,
    offs_n,
    seq_len,
    stride_cb,
    stride_co,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Cache offsets (without head/dim terms) of keys `start_n + offs_n` of one row.

    A tile inside one page reads one block id; a tile spanning pages reads one per key,
    masked to `seq_len` so a tail tile never reads past the row's block table.
    """
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(block_table_row_ptr + start_n // PAGE_SIZE).to(tl.int64)
        offsets = page * stride_cb + ((start_n % PAGE_SIZE) + offs_n) * stride_co
    else:
        keys = start_n + offs_n
        pages = tl.load(block_table_row_ptr + keys // PAGE_SIZE, mask=keys < seq_len, other=0).to(tl.int64)
        offsets = pages * stride_cb + (keys % PAGE_SIZE) * stride_co
    return offsets


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    cache_ptr,
    block_table_row_ptr,
    start_n,
    seq_len,
    q_pos,
    causal_prefix_len,
    kv_head_offset,
    offs_n,
    offs_d,
    stride_cb,
    stride_ckv,
    stride_co,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
):
    """One online-softmax step over keys `start_n .. start_n + BLOCK_N` of the row."""
    base = _kv_tile_offsets(block_table_row_ptr, start_n, offs_n, seq_len, stride_cb, stride_co, PAGE_SIZE, BLOCK_N)
    ptrs = cache_ptr + kv_head_offset + base[:, None] + offs_d[None, :]
    key_pos = start_n + offs_n
    if MASK_KEYS:
        load_mask = key_pos[:, None] < seq_len
        if BLOCK_D != HEAD_SIZE:
            load_mask = load_mask & (offs_d[None, :] < HEAD_SIZE)
        k = tl.load(ptrs, mask=load_mask, other=0.0)
        v = tl.load(ptrs + stride_ckv, mask=load_mask, other=0.0)
    elif BLOCK_D != HEAD_SIZE:
        k = tl.load(ptrs, mask=offs_d[None, :] < HEAD_SIZE, other=0.0)
        v = tl.load(ptrs + stride_ckv, mask=offs_d[None, :] < HEAD_SIZE, other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_ckv)
    if UPCAST_OPERANDS:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK_KEYS:
        qk = tl.where(key_pos[None, :] < seq_len, qk, float("-inf"))
    if MASK_CAUSAL:
        allowed = (q_pos[:, None] >= causal_prefix_len) | (key_pos[None, :] <= q_pos[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    query_pos_start_ptr,
    causal_prefix_lens_ptr,
    qk_scale,
    query_len_bucket,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_co,
    stride_ch,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_CAUSAL_PREFIX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (tile, head, row): BLOCK_M queries of one row and query head.

    `query_len_bucket` is unused in the body; the autotuner keys on it.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + row)
    num_queries = tl.load(query_start_loc_ptr + row + 1) - q_begin
    if tile * BLOCK_M < num_queries:
        seq_len = tl.load(seq_lens_ptr + row)
        pos_start = tl.load(query_pos_start_ptr + row)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_mask = offs_m[:, None] < num_queries
        if BLOCK_D != HEAD_SIZE:
            q_mask = q_mask & (offs_d[None, :] < HEAD_SIZE)
        q_rows = (q_begin + offs_m).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        if UPCAST_OPERANDS:
            q = q.to(tl.float32)
        q_pos = pos_start + offs_m
        kv_head_offset = (head // QUERIES_PER_KV).to(tl.int64) * stride_ch
        block_table_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        causal_prefix_len = 0
        tile_has_prefix_queries = False
        key_end = seq_len
        if HAS_CAUSAL_PREFIX:
            causal_prefix_len = tl.load(causal_prefix_lens_ptr + row)
            tile_has_prefix_queries = pos_start + tile * BLOCK_M < causal_prefix_len
            last_pos = pos_start + tl.minimum(tile * BLOCK_M + BLOCK_M, num_queries) - 1
            if last_pos < causal_prefix_len:
                key_end = last_pos + 1  # every query of the tile is a prefix query: later keys are masked
        if tile_has_prefix_queries:
            for start_n in range(0, key_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    cache_ptr,
                    block_table_row_ptr,
                    start_n,
                    key_end,
                    q_pos,
                    causal_prefix_len,
                    kv_head_offset,
                    offs_n,
                    offs_d,
                    stride_cb,
                    stride_ckv,
                    stride_co,
                    qk_scale,
                    PAGE_SIZE,
                    BLOCK_N,
                    HEAD_SIZE,
                    BLOCK_D,
                    True,
                    True,
                    DOT_PRECISION,
                    UPCAST_OPERANDS,
                )
        else:
            full_end = (key_end // BLOCK_N) * BLOCK_N
            for start_n in range(0, full_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    cache_ptr,
                    block_table_row_ptr,
                    start_n,
                    key_end,
                    q_pos,
                    causal_prefix_len,
                    kv_head_offset,
                    offs_n,
                    offs_d,
                    stride_cb,
                    stride_ckv,
                    stride_co,
                    qk_scale,
                    PAGE_SIZE,
                    BLOCK_N,
                    HEAD_SIZE,
                    BLOCK_D,
                    False,
                    False,
                    DOT_PRECISION,
                    UPCAST_OPERANDS,
                )
            if full_end < key_end:
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    cache_ptr,
                    block_table_row_ptr,
                    full_end,
                    key_end,
                    q_pos,
                    causal_prefix_len,
                    kv_head_offset,
                    offs_n,
                    offs_d,
                    stride_cb,
                    stride_ckv,
                    stride_co,
                    qk_scale,
                    PAGE_SIZE,
                    BLOCK_N,
                    HEAD_SIZE,
                    BLOCK_D,
                    True,
                    False,
                    DOT_PRECISION,
                    UPCAST_OPERANDS,
                )
        acc = acc / l_i[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def _query_len_bucket(max_query_len: int) -> int:
    """Autotuning key for the query length: powers of two from 256 to 16384.

    The best tile shape depends on how many programs a launch has; bucketing keeps
    that signal without re-tuning for every new length.
    """
    return min(max(triton.next_power_of_2(max_query_len), 256), 16384)


def _cuda_configs() -> list[triton.Config]:
    configs = []
    # Few, FlashAttention-like shapes: every config is one more compile per page size.
    for block_m, block_n, warps, stages in (
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 32, 4, 4),
        (64, 64, 4, 3),
    ):
        configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages))
    return configs


# Short launches are latency-bound and not worth tuning (nor the compile of every config);
# the interpreter cannot time configs at all. Both use one fixed tile shape.
AUTOTUNE_MIN_QUERY_LEN = 1024
_FIXED_TILE: dict[str, int] = (
    {"BLOCK_M": 16, "BLOCK_N": 16} if INTERPRETED else {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
)
_tuned_paged_attention = (
    None
    if INTERPRETED
    else triton.autotune(
        configs=_cuda_configs(),
        key=["query_len_bucket", "QUERIES_PER_KV", "PAGE_SIZE", "HEAD_SIZE", "HAS_CAUSAL_PREFIX"],
    )(_paged_attention_kernel)
)


def paged_attention(
    query: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, scale: float, out: Tensor
) -> Tensor:
    """Launch a `(query tiles, heads, rows)` grid; tiles past a row's queries exit at once."""
    num_rows = metadata.num_rows
    max_query_len = metadata.max_query_len
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(
            f"the Triton paged attention kernel supports head_size <= {MAX_HEAD_SIZE}, got {head_size}; "
            "use backend='torch'"
        )
    if query.stride(2) != 1:
        query = query.contiguous()
    causal_prefix_lens = metadata.causal_prefix_lens
    result = out if out.stride(2) == 1 else out.new_empty(out.shape)

    # Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits, so
    # interpreted bf16 runs its dots in fp32; compiled kernels keep bf16 tensor-core dots.
    upcast = INTERPRETED and query.dtype == torch.bfloat16

    def grid(meta):
        return (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_heads, num_rows)

    if _tuned_paged_attention is not None and max_query_len >= AUTOTUNE_MIN_QUERY_LEN:
        kernel, tile = _tuned_paged_attention, {}
    else:
        kernel, tile = _paged_attention_kernel, _FIXED_TILE
    kernel[grid](
        query,
        kv_cache,
        result,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.query_pos_start,
        causal_prefix_lens if causal_prefix_lens is not None else metadata.seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates in base 2
        _query_len_bucket(max_query_len),
        query.stride(0),
        query.stride(1),
        result.stride(0),
        result.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        metadata.block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_SIZE=head_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        HAS_CAUSAL_PREFIX=causal_prefix_lens is not None,
        # fp32 caches get exact fp32 dots (tf32 would lose ~3 digits); fp16/bf16 use tensor cores.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        UPCAST_OPERANDS=upcast,
        **tile,
    )
    if result is not out:
        out.copy_(result)
    return out
