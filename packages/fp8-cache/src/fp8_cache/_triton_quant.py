"""Dynamic FP8 quantization of activations in Triton: per tensor (two passes) or per row (one pass).

The torch expression (amax, scale arithmetic, ``(x.float() / s).clamp(...).to(fp8)``) launches about six
kernels and makes four passes over memory with float32 temporaries; at DiT shapes that costs as much as the
FP8 GEMM saves. Here pass 1 reduces ``|x|`` to one float32 ``amax`` (block maxima + one atomic max each) and
pass 2 derives the scale on the device, writes it for ``torch._scaled_mm`` and casts ``x`` to FP8: ``x`` is
read twice and one byte per element is written. Imported only on CUDA (Triton ships with CUDA torch).

The scale rule is the library's (``max(amax / FP8_MAX, MIN_SCALE)``); Triton's float32 division may differ
from IEEE division in the last bit, which is irrelevant for activations (weights use the exact torch path).

Per row (``quantize_rows_triton``), one program owns a row: it reduces the row's ``|x|``, then casts it,
re-reading the row from the cache rather than from memory (a row is a few tens of KiB at most), so ``x``
leaves memory once. The scale is an exact (round-to-nearest) division, so it equals the torch expression; the
values are multiplied by its reciprocal (one division per row: a per-element IEEE division costs more than the
memory traffic), which can move a value lying within a float32 rounding of an FP8 rounding boundary by one
FP8 step (never for power-of-two scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_cache.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

_AMAX_BLOCK = 8192
_CAST_BLOCK = 4096
_ROW_BLOCK_MAX = 4096


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n_elements, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _scale_and_cast_kernel(x_ptr, amax_ptr, scale_ptr, out_ptr, n_elements, fp8_max, min_scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    scale = tl.maximum(tl.load(amax_ptr) / fp8_max, min_scale)
    if pid == 0:
        tl.store(scale_ptr, scale)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_activation_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 copy of contiguous x, float32 0-dim scale)``, both on ``x.device``; no host synchronisation."""
    n = x.numel()
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if n:
        _amax_kernel[(triton.cdiv(n, _AMAX_BLOCK),)](x, amax, n, BLOCK=_AMAX_BLOCK, num_warps=8)
    _scale_and_cast_kernel[(max(1, triton.cdiv(n, _CAST_BLOCK)),)](
        x, amax, scale, out, n, FP8_MAX, MIN_SCALE, BLOCK=_CAST_BLOCK, num_warps=8
    )
    return out, scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    width,
    stride_x,
    stride_out,
    fp8_max,
    min_scale,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in tl.static_range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), fp8_max), min_scale)
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(scale_ptr + row, scale)
    for chunk in tl.static_range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        mask = offs < width
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * inverse, -fp8_max, fp8_max)
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 copy of 2-D x, float32 [rows, 1] scales)``; x may have any row stride (its last dim contiguous)."""
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale
    if width == 0:
        scale.fill_(MIN_SCALE)
        return out, scale
    block = min(triton.next_power_of_2(width), _ROW_BLOCK_MAX)
    _quantize_rows_kernel[(rows,)](
        x,
        out,
        scale,
        width,
        x.stride(0),
        out.stride(0),
        FP8_MAX,
        MIN_SCALE,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(width, block),
        num_warps=4 if block <= 1024 else 8,
    )
    return out, scale
