"""Dynamic per-tensor FP8 quantization of activations in two Triton passes.

The torch expression (amax, scale arithmetic, ``(x.float() / s).clamp(...).to(fp8)``) launches about six
kernels and makes four passes over memory with float32 temporaries; at DiT shapes that costs as much as the
FP8 GEMM saves. Here pass 1 reduces ``|x|`` to one float32 ``amax`` (block maxima + one atomic max each) and
pass 2 derives the scale on the device, writes it for ``torch._scaled_mm`` and casts ``x`` to FP8: ``x`` is
read twice and one byte per element is written. Imported only on CUDA (Triton ships with CUDA torch).

The scale rule is the library's (``max(amax / FP8_MAX, MIN_SCALE)``); Triton's float32 division may differ
from IEEE division in the last bit, which is irrelevant for activations (weights use the exact torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_cache.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

_AMAX_BLOCK = 8192
_CAST_BLOCK = 4096


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n_elements, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _scale_and_cast_kernel(x_ptr, amax_ptr, scale_ptr, out_ptr, n_elements, fp8_max, min_scale,
                           BLOCK: tl.constexpr):
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
