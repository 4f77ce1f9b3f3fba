"""Triton kernels of ``omni_models.lora`` (CUDA; also runs under ``TRITON_INTERPRET=1`` for the CPU tests).

Punica's SGMV pair, with a row of the DiT batch as the segment: every program works inside one row, reads that
row's slot index, and returns at once when it is -1 (no adapter), so such a row's output is never written.

- shrink: ``t[b, s, :] = x[b, s, :] @ down[slot_b]^T`` (float32 ``[B, S, R]``); grid (token tiles, rows, rank
  tiles), reduction over ``in`` in ``BLOCK_K`` chunks;
- expand: ``y[b, s, :] += scales[b] * scaling[slot_b] * t[b, s, :] @ up[slot_b]^T``; grid (token tiles, rows,
  output tiles), ``t`` cast to the weights' dtype first (PEFT rounds ``lora_A(x)`` to the activation dtype too).

Both accumulate in float32; float32 inputs multiply in IEEE float32 (no TF32), so the CPU tests and an fp32 GPU
run compare against the reference at float32 rounding. Inputs are validated by ``omni_models.lora``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``: IEEE float32 for float32 operands; ``UPCAST`` multiplies bf16 operands as float32 (exact
    products), for the interpreter, whose bf16 ``tl.dot`` is wrong."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    return acc + tl.dot(a, b)


@triton.jit
def _shrink_kernel(
    x_ptr,
    down_ptr,
    slots_ptr,
    t_ptr,
    tokens,
    in_features,
    stride_xb,
    stride_xs,
    stride_dl,
    stride_dr,
    stride_tb,
    stride_ts,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xb + offs_m[:, None] * stride_xs
    down = down_ptr + slot * stride_dl + offs_r[None, :] * stride_dr
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        cols = k + offs_k
        x = tl.load(x_row + cols[None, :], mask=(offs_m[:, None] < tokens) & (cols[None, :] < in_features), other=0.0)
        a = tl.load(down + cols[:, None], mask=cols[:, None] < in_features, other=0.0)
        acc = _dot(x, a, acc, IEEE, UPCAST)
    t = t_ptr + row * stride_tb + offs_m[:, None] * stride_ts + offs_r[None, :]
    tl.store(t, acc, mask=offs_m[:, None] < tokens)


@triton.jit
def _expand_kernel(
    t_ptr,
    up_ptr,
    scaling_ptr,
    slots_ptr,
    scales_ptr,
    y_ptr,
    tokens,
    out_features,
    rank,
    stride_tb,
    stride_ts,
    stride_ul,
    stride_un,
    stride_yb,
    stride_ys,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    factor = tl.load(scales_ptr + row) * tl.load(scaling_ptr + slot)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    t_row = t_ptr + row * stride_tb + offs_m[:, None] * stride_ts
    up = up_ptr + slot * stride_ul + offs_n[None, :] * stride_un
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        cols = r + offs_r
        t = tl.load(t_row + cols[None, :], mask=offs_m[:, None] < tokens, other=0.0)
        b = tl.load(up + cols[:, None], mask=offs_n[None, :] < out_features, other=0.0)
        acc = _dot(t.to(b.dtype), b, acc, IEEE, UPCAST)
    mask = (offs_m[:, None] < tokens) & (offs_n[None, :] < out_features)
    y = y_ptr + row * stride_yb + offs_m[:, None] * stride_ys + offs_n[None, :]
    # The delta is rounded to y's dtype, then added in float32 and rounded once: torch's ``y + delta`` (PEFT adds
    # ``lora_B(...) * scaling`` to the base output the same way).
    dtype = y_ptr.dtype.element_ty
    delta = (acc * factor).to(dtype).to(tl.float32)
    tl.store(y, (tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta).to(dtype), mask=mask)


def _block(extent: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(extent, 1))))


def lora_shrink_expand(
    y: Tensor, x: Tensor, down: Tensor, up: Tensor, scaling: Tensor, slots: Tensor, scales: Tensor
) -> None:
    """``y [B, S, out] += `` each row's delta (see ``omni_models.lora.lora_delta_reference``), in place.
    ``x [B, S, in]``, ``down [L, R, in]`` and ``up [L, out, R]`` with unit last strides (a slot's stride is free:
    the runtime's slots are views of one buffer), R a power of two >= 16."""
    batch, tokens, in_features = x.shape
    out_features, rank = up.shape[1], up.shape[2]
    if y.stride(-1) != 1 or x.stride(-1) != 1 or down.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("lora_shrink_expand needs unit last strides")
    ieee = x.dtype == torch.float32
    upcast = INTERPRETED and x.dtype == torch.bfloat16
    block_m = _block(tokens, 64)
    block_r = min(rank, 64)
    shrunk = torch.empty(batch, tokens, rank, device=x.device, dtype=torch.float32)
    _shrink_kernel[(triton.cdiv(tokens, block_m), batch, rank // block_r)](
        x,
        down,
        slots,
        shrunk,
        tokens,
        in_features,
        x.stride(0),
        x.stride(1),
        down.stride(0),
        down.stride(1),
        shrunk.stride(0),
        shrunk.stride(1),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=_block(in_features, 64),
        IEEE=ieee,
        UPCAST=upcast,
    )
    block_n = _block(out_features, 128 if not INTERPRETED else 64)
    _expand_kernel[(triton.cdiv(tokens, block_m), batch, triton.cdiv(out_features, block_n))](
        shrunk,
        up,
        scaling,
        slots,
        scales,
        y,
        tokens,
        out_features,
        rank,
        shrunk.stride(0),
        shrunk.stride(1),
        up.stride(0),
        up.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        IEEE=ieee,
        UPCAST=upcast,
    )


__all__ = ["INTERPRETED", "lora_shrink_expand"]
