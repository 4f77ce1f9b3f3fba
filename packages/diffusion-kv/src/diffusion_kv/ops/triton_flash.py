"""Hopper paged attention: TMA tile loads from the paged cache into shared memory, wgmma dots.

Same contract as ``triton_kernels.paged_attention`` (ragged rows, block tables, GQA, optional causal prefix),
for the shapes where the cache can be read in whole tiles: page size a multiple of the key tile (64 on a GPU),
head size 64 or 128, fp16/bf16, a contiguous cache. ``supported()`` says why a call does not qualify; the
caller then uses ``triton_kernels``.

Program (query tile, head, row): BLOCK_M queries of one row and query head, online softmax in fp32 (base 2,
scale folded into one multiply-add), ``acc`` updated by the second dot in place. The cache is seen as one 2-D
tensor ``[num_blocks * 2 * page, num_kv_heads * head_size]`` (row ``(block * 2 + kv) * page + offset``), so a
key tile of one kv head inside one page is a ``[BLOCK_N, head_size]`` box: one TMA load through a tensor
descriptor, landing in shared memory where wgmma reads it. The key range of a tile splits in two loops:
- keys every query of the tile sees, in whole tiles: unmasked TMA loads, software-pipelined ``num_stages`` deep;
- the rest (the row's last partial tile; for tiles holding causal-prefix queries, the band where the mask
  bites): masked pointer loads, so nothing past ``seq_len`` (unwritten slots may hold NaN) is read.
Queries come in through a descriptor too (rows past the row's own are loaded but never stored); the output is
written with masked stores. Inputs are validated by ``diffusion_kv.ops`` before they reach these launchers.

Warp specialization is not used: Triton 3.6's Hopper warp-specialization pass fails on this kernel (an MLIR
dominance assertion, measured on the H200 on 2026-11-30, every tile shape), so the main loop relies on
software pipelining; the tile shapes autotuned below are the ones measured fastest there.

FP8 (``paged_attention_fp8``, non-causal): ``float8_e4m3fn`` queries and cache with one float32 scale per head
(``q_scale [num_heads]``, ``k_scale``/``v_scale [num_kv_heads]``). FP8 wgmma reads both operands K-major, so
the FP8 cache stores each page's V transposed: the V half of block b holds ``[num_kv_heads, head_size, page]``
(``write_kv_cache_fp8`` writes it so). Scores ``q8 . k8`` are scaled by ``q_scale * k_scale``; the softmax
probabilities go to e4m3 for the second dot, whose result is scaled by ``v_scale``; accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs

from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata

INTERPRETED: bool = bool(knobs.runtime.interpret)
SUPPORTED_HEAD_SIZES = (64, 128)
MIN_PAGE_TILE = 16 if INTERPRETED else 64  # the smallest key tile; the page size must be a multiple of it


@triton.jit
def _masked_tile(
    acc,
    m_i,
    l_i,
    q,
    cache_ptr,
    bt_row_ptr,
    start_n,
    key_end,
    q_pos,
    causal_prefix_len,
    kv_col,
    offs_n,
    offs_d,
    stride_cb,
    stride_ckv,
    stride_co,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step over keys ``start_n + offs_n`` with pointer loads masked to ``key_end``."""
    keys = start_n + offs_n
    valid = keys < key_end
    pages = tl.load(bt_row_ptr + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    rows = pages * stride_cb + (keys % PAGE_SIZE) * stride_co + kv_col
    ptrs = cache_ptr + rows[:, None] + offs_d[None, :]
    k = tl.load(ptrs, mask=valid[:, None], other=0.0)
    v = tl.load(ptrs + stride_ckv, mask=valid[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    allowed = valid[None, :]
    if MASK_CAUSAL:
        allowed = allowed & ((q_pos[:, None] >= causal_prefix_len) | (keys[None, :] <= q_pos[:, None]))
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _flash_paged_kernel(
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
    total_q,
    cache_rows,
    stride_qt,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_co,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HAS_CAUSAL_PREFIX: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``query_len_bucket`` is unused in the body; the autotuner keys on it."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + row)
    num_queries = tl.load(query_start_loc_ptr + row + 1) - q_begin
    if tile * BLOCK_M < num_queries:
        seq_len = tl.load(seq_lens_ptr + row)
        pos_start = tl.load(query_pos_start_ptr + row)
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        kv_col = kv_head * HEAD_SIZE
        q_desc = tl.make_tensor_descriptor(
            q_ptr, shape=[total_q, NUM_HEADS * HEAD_SIZE], strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_SIZE]
        )
        kv_desc = tl.make_tensor_descriptor(
            cache_ptr,
            shape=[cache_rows, NUM_KV_HEADS * HEAD_SIZE],
            strides=[NUM_KV_HEADS * HEAD_SIZE, 1],
            block_shape=[BLOCK_N, HEAD_SIZE],
        )
        q = q_desc.load([q_begin + tile * BLOCK_M, head * HEAD_SIZE])
        if UPCAST:
            q = q.to(tl.float32)
        bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_SIZE)
        q_pos = pos_start + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)

        # Keys [0, open_end) are seen by every query of the tile and lie in whole tiles below seq_len.
        key_end = seq_len
        open_end = (seq_len // BLOCK_N) * BLOCK_N
        causal_prefix_len = 0
        if HAS_CAUSAL_PREFIX:
            causal_prefix_len = tl.load(causal_prefix_lens_ptr + row)
            first_pos = pos_start + tile * BLOCK_M
            if first_pos < causal_prefix_len:
                last_pos = pos_start + tl.minimum(tile * BLOCK_M + BLOCK_M, num_queries) - 1
                if last_pos < causal_prefix_len:
                    key_end = last_pos + 1  # every query of the tile is a prefix query: later keys are masked
                open_end = tl.minimum(open_end, (first_pos // BLOCK_N) * BLOCK_N)

        for start_n in range(0, open_end, BLOCK_N):
            page = tl.load(bt_row_ptr + start_n // PAGE_SIZE)
            k_row = page * (2 * PAGE_SIZE) + start_n % PAGE_SIZE
            k = kv_desc.load([k_row, kv_col])
            v = kv_desc.load([k_row + PAGE_SIZE, kv_col])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, k.T)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

        for start_n in range(open_end, key_end, BLOCK_N):
            acc, m_i, l_i = _masked_tile(
                acc,
                m_i,
                l_i,
                q,
                cache_ptr,
                bt_row_ptr,
                start_n,
                key_end,
                q_pos,
                causal_prefix_len,
                kv_col,
                offs_n,
                offs_d,
                stride_cb,
                stride_ckv,
                stride_co,
                qk_scale,
                PAGE_SIZE,
                HAS_CAUSAL_PREFIX,
                UPCAST,
            )

        acc = acc / l_i[:, None]
        out_rows = (q_begin + offs_m).to(tl.int64)
        out_ptrs = out_ptr + out_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < num_queries)


@triton.jit
def _flash_paged_fp8_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    q_scale_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sm_scale_log2,
    query_len_bucket,
    total_q,
    num_blocks,
    stride_qt,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Non-causal FP8 attention; the tail tile is a TMA load too, its keys past ``seq_len`` zeroed before use."""
    kv_width: tl.constexpr = NUM_KV_HEADS * HEAD_SIZE
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + row)
    num_queries = tl.load(query_start_loc_ptr + row + 1) - q_begin
    if tile * BLOCK_M < num_queries:
        seq_len = tl.load(seq_lens_ptr + row)
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        q_desc = tl.make_tensor_descriptor(
            q_ptr, shape=[total_q, NUM_HEADS * HEAD_SIZE], strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_SIZE]
        )
        k_desc = tl.make_tensor_descriptor(
            cache_ptr,
            shape=[num_blocks * 2 * PAGE_SIZE, kv_width],
            strides=[kv_width, 1],
            block_shape=[BLOCK_N, HEAD_SIZE],
        )
        vt_desc = tl.make_tensor_descriptor(
            cache_ptr,
            shape=[num_blocks * 2 * kv_width, PAGE_SIZE],
            strides=[PAGE_SIZE, 1],
            block_shape=[HEAD_SIZE, BLOCK_N],
        )
        q = q_desc.load([q_begin + tile * BLOCK_M, head * HEAD_SIZE])
        qk_scale = tl.load(q_scale_ptr + head) * tl.load(k_scale_ptr + kv_head) * sm_scale_log2
        if UPCAST:
            q = q.to(tl.float32)
        bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_SIZE)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
        full_end = (seq_len // BLOCK_N) * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            page = tl.load(bt_row_ptr + start_n // PAGE_SIZE)
            k = k_desc.load([page * (2 * PAGE_SIZE) + start_n % PAGE_SIZE, kv_head * HEAD_SIZE])
            vt = vt_desc.load([(page * 2 + 1) * kv_width + kv_head * HEAD_SIZE, start_n % PAGE_SIZE])
            if UPCAST:
                k = k.to(tl.float32)
                vt = vt.to(tl.float32)
            qk = tl.dot(q, k.T)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(vt.dtype), vt.T, acc)
            m_i = m_new
        if full_end < seq_len:
            page = tl.load(bt_row_ptr + full_end // PAGE_SIZE)
            keys = full_end + offs_n
            valid = keys < seq_len
            k = k_desc.load([page * (2 * PAGE_SIZE) + full_end % PAGE_SIZE, kv_head * HEAD_SIZE])
            vt = vt_desc.load([(page * 2 + 1) * kv_width + kv_head * HEAD_SIZE, full_end % PAGE_SIZE])
            # Slots past seq_len hold whatever was there: zero them so no NaN/inf pattern reaches a dot.
            k = tl.where(valid[:, None], k.to(tl.float32), 0.0).to(k.dtype)
            vt = tl.where(valid[None, :], vt.to(tl.float32), 0.0).to(vt.dtype)
            if UPCAST:
                k = k.to(tl.float32)
                vt = vt.to(tl.float32)
            qk = tl.where(valid[None, :], tl.dot(q, k.T) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(vt.dtype), vt.T, acc)
        acc = acc * (tl.load(v_scale_ptr + kv_head) / l_i)[:, None]
        out_rows = (q_begin + offs_m).to(tl.int64)
        out_ptrs = out_ptr + out_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < num_queries)


@triton.jit
def _write_kv_fp8_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    fp8_max,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token: K quantized into ``[page, heads, dims]``, V into the page's transposed ``[heads, dims, page]``."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, HEAD_SIZE)[None, :]
        mask = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale_ptr + heads, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=mask, other=1.0)
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0).to(tl.float32)
        k8 = tl.clamp(tl.math.div_rn(k, k_scale), -fp8_max, fp8_max).to(cache_ptr.dtype.element_ty)
        v8 = tl.clamp(tl.math.div_rn(v, v_scale), -fp8_max, fp8_max).to(cache_ptr.dtype.element_ty)
        block_base = block * (2 * PAGE_SIZE * NUM_KV_HEADS * HEAD_SIZE)
        tl.store(cache_ptr + block_base + offset * (NUM_KV_HEADS * HEAD_SIZE) + heads * HEAD_SIZE + dims, k8, mask=mask)
        v_base = block_base + PAGE_SIZE * NUM_KV_HEADS * HEAD_SIZE
        tl.store(cache_ptr + v_base + (heads * HEAD_SIZE + dims) * PAGE_SIZE + offset, v8, mask=mask)


def _query_len_bucket(max_query_len: int) -> int:
    return min(max(triton.next_power_of_2(max_query_len), 256), 32768)


def _prune(configs, named_args, **kwargs):
    """Keep key tiles that divide the page (a TMA box never crosses a page)."""
    page = kwargs.get("PAGE_SIZE", named_args.get("PAGE_SIZE"))
    if page is None:
        return configs
    kept = [c for c in configs if page % c.kwargs["BLOCK_N"] == 0]
    return kept or configs[-1:]


def _cuda_configs() -> list[triton.Config]:
    # (BLOCK_M, BLOCK_N, warps, stages). On the H200 (2026-11-30, D 128, bf16) 128x64 with one warp group and
    # three stages was fastest at every S and page size (468-499 TFLOP/s), 128x128 with 8 warps next (432-465),
    # 128x64 with 8 warps slowest (344-370, left out). 64-row tiles give short rows (the DiT's 1024 queries per
    # row and head) more programs per wave.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3))
    ]


AUTOTUNE_MIN_QUERY_LEN = 1024
_FIXED_TILE: dict = (
    {"BLOCK_M": 16, "BLOCK_N": 16} if INTERPRETED else {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
)
_tuned = (
    None
    if INTERPRETED
    else triton.autotune(
        configs=_cuda_configs(),
        key=["query_len_bucket", "NUM_HEADS", "NUM_KV_HEADS", "PAGE_SIZE", "HEAD_SIZE", "HAS_CAUSAL_PREFIX"],
        prune_configs_by={"early_config_prune": _prune},
    )(_flash_paged_kernel)
)

_allocator_ready = False


def _ensure_allocator(device: torch.device) -> None:
    """Device-side tensor descriptors need scratch memory: give Triton torch's allocator unless one is set."""
    global _allocator_ready
    if _allocator_ready:
        return
    try:
        from triton.runtime import _allocation

        already = not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):
        already = False
    if not already:
        kind = device.type

        def alloc(size: int, alignment: int, stream) -> Tensor:
            return torch.empty(size, dtype=torch.int8, device=kind)

        triton.set_allocator(alloc)
    _allocator_ready = True


def supported(query: Tensor, kv_cache: Tensor) -> str | None:
    """Why this kernel cannot run the call (None when it can)."""
    page_size, head_size = kv_cache.shape[2], kv_cache.shape[4]
    if query.device.type != "cuda" and not INTERPRETED:
        return "not a CUDA tensor"
    if query.device.type == "cuda" and torch.cuda.get_device_capability(query.device) < (9, 0):
        return "tensor-descriptor (TMA) loads need compute capability 9.0+"
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        return f"dtype {kv_cache.dtype} (fp16/bf16/e4m3 only; fp32 caches keep exact fp32 dots)"
    if head_size not in SUPPORTED_HEAD_SIZES and not (INTERPRETED and head_size in (16, 32)):
        return f"head_size {head_size} not in {SUPPORTED_HEAD_SIZES}"
    if page_size % MIN_PAGE_TILE:
        return f"page size {page_size} is not a multiple of {MIN_PAGE_TILE}"
    if not kv_cache.is_contiguous():
        return "the cache is not contiguous"
    if query.stride(2) != 1 or query.stride(1) != head_size or (query.stride(0) * query.element_size()) % 16:
        return "query heads are not packed rows of 16-byte-aligned stride"
    if query.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "a base pointer is not 16-byte aligned"
    return None


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    out: Tensor,
    *,
    config: dict | None = None,
) -> Tensor:
    """Launch a ``(query tiles, heads, rows)`` grid; the caller checked ``supported()``.

    ``config`` pins a tile shape (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``)
    instead of autotuning, for benchmarks that compare variants.
    """
    num_rows, max_query_len = metadata.num_rows, metadata.max_query_len
    num_heads, head_size = query.shape[1], query.shape[2]
    num_blocks, _, page_size, num_kv_heads, _ = kv_cache.shape
    _ensure_allocator(query.device)
    causal_prefix_lens = metadata.causal_prefix_lens
    result = out if out.stride(2) == 1 else out.new_empty(out.shape)
    # The interpreter multiplies bf16 dot operands as raw bits: interpreted bf16 dots run in fp32.
    upcast = INTERPRETED and query.dtype == torch.bfloat16

    def grid(meta):
        return (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_heads, num_rows)

    if config is not None:
        kernel, tile = _flash_paged_kernel, config
    elif _tuned is not None and max_query_len >= AUTOTUNE_MIN_QUERY_LEN:
        kernel, tile = _tuned, {}
    else:
        kernel, tile = _flash_paged_kernel, dict(_FIXED_TILE)
        if page_size % tile["BLOCK_N"]:
            raise ValueError(f"page size {page_size} is not a multiple of the key tile {tile['BLOCK_N']}")
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
        query.shape[0],
        num_blocks * 2 * page_size,
        query.stride(0),
        result.stride(0),
        result.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        metadata.block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_SIZE=head_size,
        HAS_CAUSAL_PREFIX=causal_prefix_lens is not None,
        UPCAST=upcast,
        **tile,
    )
    if result is not out:
        out.copy_(result)
    return out


def _fp8_cuda_configs() -> list[triton.Config]:
    # Measured on the H200 (2026-12-01, D 128, S 16k/32k): one warp group is fastest. 128x128 with 4 warps and
    # 3-4 stages 775-786 TFLOP/s (page 256); 128x64 with 4 warps needs 5 stages (749-755, against 661-699 at 3-4
    # stages) and is the best tile for pages of 64. 8-warp and 256-row tiles ran at 503-670.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in ((128, 128, 4, 3), (128, 128, 4, 4), (128, 64, 4, 5), (128, 64, 4, 3))
    ]


_tuned_fp8 = (
    None
    if INTERPRETED
    else triton.autotune(
        configs=_fp8_cuda_configs(),
        key=["query_len_bucket", "NUM_HEADS", "NUM_KV_HEADS", "PAGE_SIZE", "HEAD_SIZE"],
        prune_configs_by={"early_config_prune": _prune},
    )(_flash_paged_fp8_kernel)
)


def paged_attention_fp8(
    query: Tensor,
    q_scale: Tensor,
    kv_cache: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    out: Tensor,
    *,
    config: dict | None = None,
) -> Tensor:
    """Launch the FP8 kernel (non-causal; every query of row r sees keys ``0..seq_lens[r]-1``)."""
    num_rows, max_query_len = metadata.num_rows, metadata.max_query_len
    num_heads, head_size = query.shape[1], query.shape[2]
    num_blocks, _, page_size, num_kv_heads, _ = kv_cache.shape
    _ensure_allocator(query.device)
    # The interpreter cannot multiply fp8 dot operands: interpreted dots run in fp32 on the same fp8 values.
    upcast = INTERPRETED

    def grid(meta):
        return (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_heads, num_rows)

    if config is not None:
        kernel, tile = _flash_paged_fp8_kernel, config
    elif _tuned_fp8 is not None and max_query_len >= AUTOTUNE_MIN_QUERY_LEN:
        kernel, tile = _tuned_fp8, {}
    else:
        kernel, tile = _flash_paged_fp8_kernel, dict(_FIXED_TILE)
    kernel[grid](
        query,
        kv_cache,
        out,
        q_scale,
        k_scale,
        v_scale,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale * 1.4426950408889634,
        _query_len_bucket(max_query_len),
        query.shape[0],
        num_blocks,
        query.stride(0),
        out.stride(0),
        out.stride(1),
        metadata.block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_SIZE=head_size,
        UPCAST=upcast,
        **tile,
    )
    return out


def write_kv_cache_fp8(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    metadata: PagedAttentionMetadata,
    k_scale: Tensor,
    v_scale: Tensor,
    fp8_max: float,
) -> None:
    """One program per token; negative slots are skipped."""
    _, _, page_size, num_kv_heads, head_size = kv_cache.shape
    _write_kv_fp8_kernel[(key.shape[0],)](
        key,
        value,
        kv_cache,
        metadata.slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        fp8_max,
        PAGE_SIZE=page_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )
