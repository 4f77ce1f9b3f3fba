"""Triton kernels of ``omni_models.fused`` (CUDA; also runs under ``TRITON_INTERPRET=1`` for the CPU tests).

Every kernel gives one program one token (a row of ``width`` channels, all in registers): it reads the token
once, its request's modulation rows (``shift``/``scale``/``gate`` ``[R, width]``, picked by ``row_ids[token]``,
so ``[tokens, width]`` copies of them never exist), computes in float32 and writes each output once. With
``QUANTIZE`` the output is FP8 ``float8_e4m3fn`` with one float32 scale per token, following fp8_cache's
contract (``scale = max(amax / fp8_max, min_scale)``, ``q = fp8(clamp(y / scale))``). The scale is computed with
round-to-nearest division; values are multiplied by its reciprocal (one division per token, not per element),
which can move a value that sits within a float32 rounding of an FP8 rounding boundary by one FP8 step. GELU
(the MLP's ``4 * width`` hidden units) walks its token in chunks, computing GELU twice (for the amax, then for
the cast) rather than holding the whole row in registers. Inputs are validated by ``omni_models.fused``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
MAX_WIDTH = 16384  # one token's channels live in one program's registers


@triton.jit
def _store_token(y, out_ptr, out_scale_ptr, token, stride_out, cols, mask, fp8_max, min_scale, QUANTIZE: tl.constexpr):
    """Write one token's float32 values, cast to the output dtype or quantized with a per-token scale."""
    if QUANTIZE:
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)
        y = tl.clamp(y * tl.math.div_rn(1.0, scale), -fp8_max, fp8_max)
        tl.store(out_scale_ptr + token, scale)
    tl.store(out_ptr + token * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_modulate(x, mask, width, eps, shift, scale):
    """LayerNorm without affine of one token (float32), then ``* (1 + scale) + shift``."""
    mean = tl.sum(x, axis=0) / width
    centered = tl.where(mask, x - mean, 0.0)
    variance = tl.sum(centered * centered, axis=0) / width
    return centered * (1.0 / tl.sqrt(variance + eps)) * (1.0 + scale) + shift


@triton.jit
def _layer_norm_modulate_kernel(
    x_ptr,
    shift_ptr,
    scale_ptr,
    row_ids_ptr,
    out_ptr,
    out_scale_ptr,
    width,
    stride_x,
    stride_shift,
    stride_scale,
    stride_out,
    eps,
    fp8_max,
    min_scale,
    BLOCK: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    row = tl.load(row_ids_ptr + token).to(tl.int64)
    x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + row * stride_shift + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + row * stride_scale + cols, mask=mask, other=0.0).to(tl.float32)
    y = _layer_norm_modulate(x, mask, width, eps, shift, scale)
    _store_token(y, out_ptr, out_scale_ptr, token, stride_out, cols, mask, fp8_max, min_scale, QUANTIZE)


@triton.jit
def _gated_residual_kernel(
    residual_ptr,
    gate_ptr,
    branch_ptr,
    shift_ptr,
    scale_ptr,
    row_ids_ptr,
    residual_out_ptr,
    out_ptr,
    out_scale_ptr,
    width,
    stride_residual,
    stride_gate,
    stride_branch,
    stride_shift,
    stride_scale,
    stride_residual_out,
    stride_out,
    eps,
    fp8_max,
    min_scale,
    BLOCK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """``residual + gate[row] * branch``, rounded to the residual dtype; with NORMALIZE also LayerNorm + modulate."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    row = tl.load(row_ids_ptr + token).to(tl.int64)
    residual = tl.load(residual_ptr + token * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    branch = tl.load(branch_ptr + token * stride_branch + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    updated = (residual + gate * branch).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + token * stride_residual_out + cols, updated, mask=mask)
    if NORMALIZE:
        shift = tl.load(shift_ptr + row * stride_shift + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + row * stride_scale + cols, mask=mask, other=0.0).to(tl.float32)
        y = _layer_norm_modulate(updated.to(tl.float32), mask, width, eps, shift, scale)
        _store_token(y, out_ptr, out_scale_ptr, token, stride_out, cols, mask, fp8_max, min_scale, QUANTIZE)


@triton.jit
def _gelu(x):
    """tanh-GELU: ``0.5 x (1 + tanh(u)) == x * sigmoid(2u)``, ``u = sqrt(2 / pi) (x + 0.044715 x^3)``."""
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def _gelu_quantize_kernel(
    x_ptr,
    out_ptr,
    out_scale_ptr,
    width,
    stride_x,
    stride_out,
    fp8_max,
    min_scale,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    """tanh-GELU of one token, quantized with the token's scale; the token is read in BLOCK-wide chunks twice."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        x = tl.load(x_ptr + token * stride_x + offs, mask=offs < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(_gelu(x)))  # masked lanes hold GELU(0) = 0
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), fp8_max), min_scale)
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(out_scale_ptr + token, scale)
    for chunk in range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        mask = offs < width
        x = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(_gelu(x) * inverse, -fp8_max, fp8_max)
        tl.store(out_ptr + token * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_heads_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """RMS norm over ``head_size`` of every head of one token, times the per-channel weight."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_SIZE)
    x = tl.load(x_ptr + token * stride_xt + heads * stride_xh + dims, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + dims, mask=dims < HEAD_SIZE, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=1) / HEAD_SIZE
    y = x * (1.0 / tl.sqrt(mean_square + eps))[:, None] * weight
    tl.store(out_ptr + token * stride_ot + heads * stride_oh + dims, y.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _block(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def layer_norm_modulate(
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    row_ids: Tensor,
    eps: float,
    out: Tensor,
    out_scale: Tensor | None,
    fp8_max: float,
    min_scale: float,
) -> None:
    tokens, width = x.shape
    block = _block(width)
    _layer_norm_modulate_kernel[(tokens,)](
        x,
        shift,
        scale,
        row_ids,
        out,
        out_scale if out_scale is not None else out,
        width,
        x.stride(0),
        shift.stride(0),
        scale.stride(0),
        out.stride(0),
        eps,
        fp8_max,
        min_scale,
        BLOCK=block,
        QUANTIZE=out_scale is not None,
        num_warps=_warps(block),
    )


def gated_residual(
    residual: Tensor,
    gate: Tensor,
    branch: Tensor,
    row_ids: Tensor,
    residual_out: Tensor,
    norm: tuple[Tensor, Tensor, float, Tensor, Tensor | None] | None,
    fp8_max: float,
    min_scale: float,
) -> None:
    """``norm``: None, or ``(shift, scale, eps, out, out_scale)`` to also write the modulated LayerNorm."""
    tokens, width = residual.shape
    block = _block(width)
    if norm is None:
        shift = scale = out = residual_out
        out_scale, eps = None, 0.0
    else:
        shift, scale, eps, out, out_scale = norm
    _gated_residual_kernel[(tokens,)](
        residual,
        gate,
        branch,
        shift,
        scale,
        row_ids,
        residual_out,
        out,
        out_scale if out_scale is not None else out,
        width,
        residual.stride(0),
        gate.stride(0),
        branch.stride(0),
        shift.stride(0),
        scale.stride(0),
        residual_out.stride(0),
        out.stride(0),
        eps,
        fp8_max,
        min_scale,
        BLOCK=block,
        NORMALIZE=norm is not None,
        QUANTIZE=out_scale is not None,
        num_warps=_warps(block),
    )


GELU_CHUNK = 2048


def gelu_quantize(x: Tensor, out: Tensor, out_scale: Tensor, fp8_max: float, min_scale: float) -> None:
    tokens, width = x.shape
    block = min(_block(width), GELU_CHUNK)
    _gelu_quantize_kernel[(tokens,)](
        x,
        out,
        out_scale,
        width,
        x.stride(0),
        out.stride(0),
        fp8_max,
        min_scale,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(width, block),
        num_warps=_warps(block),
    )


def rms_norm_heads(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    tokens, num_heads, head_size = x.shape
    block_h, block_d = triton.next_power_of_2(num_heads), max(16, triton.next_power_of_2(head_size))
    _rms_norm_heads_kernel[(tokens,)](
        x,
        weight,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        eps,
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=_warps(block_h * block_d),
    )
