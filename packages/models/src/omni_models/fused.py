"""Fused ops of the DiT's token path: indexed adaLN modulation, gated residuals, QK RMS norm, GELU + FP8.

When rows at different timesteps share one forward (the paged runner's flat ``[tokens, width]`` layout), each
token must use its own request's adaLN modulation. The modulation comes per request row (``shift``, ``scale``,
``gate``: ``[R, width]``, typically column slices of one ``[R, 6 * width]`` projection) and ``row_ids[token]``
picks the row. The unfused torch sequence first gathers ``[tokens, width]`` copies of every modulation tensor
and then runs LayerNorm, ``1 + scale``, multiply and add as separate passes with rounded temporaries. Here each
op reads every token once, reads the modulation rows by index, accumulates in float32 and rounds once:

- ``layer_norm_modulate``: ``LayerNorm(x) * (1 + scale[row]) + shift[row]`` (LayerNorm without affine);
- ``gated_residual``: ``residual + gate[row] * branch``;
- ``gated_residual_layer_norm_modulate``: both of the above in one pass (the residual update, then the next
  norm of the updated residual, exactly as the two ops in sequence);
- ``gelu_quantize``: tanh-GELU, quantized to FP8;
- ``rms_norm``: per-head RMS norm times a weight (the QK norm).

FP8 mode (``quantize=True``) writes ``float8_e4m3fn`` with one float32 scale per token, under fp8_cache's
contract, and returns an ``fp8_cache.FP8Activation`` that an ``FP8Linear`` consumes without quantizing again:
the quantization costs no pass of its own. ``wants_fp8_input(linear, x)`` says when a consumer takes it.

Backends: ``"auto"`` runs the Triton kernels on CUDA tensors (under ``torch.no_grad``/inference, or when no
input requires grad) and the torch reference otherwise; ``"torch"`` and ``"triton"`` force one (``"triton"``
on CPU tensors needs ``TRITON_INTERPRET=1`` set before ``omni_models._fused_triton`` is first imported).
The torch reference defines the semantics; the kernels match it within float32 rounding (FP8 bytes may differ
where a value sits on a rounding boundary).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from fp8_cache import FP8Activation

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")
_MAX_TRITON_WIDTH = 16384


def triton_interpreter_active() -> bool:
    """True when the fused kernels were (or will be) built for the CPU interpreter."""
    module = sys.modules.get("omni_models._fused_triton")
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels():
    try:
        from omni_models import _fused_triton
    except ImportError:
        return None
    return _fused_triton


def _use_triton(backend: str, tensors: tuple[Tensor, ...], width: int) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    on_cuda = tensors[0].device.type == "cuda"
    if backend == "triton":
        if not on_cuda and not triton_interpreter_active():
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "omni_models._fused_triton is imported, or use backend='torch'"
            )
        if width > _MAX_TRITON_WIDTH:
            raise ValueError(f"the fused kernels hold one token in registers: width {width} > {_MAX_TRITON_WIDTH}")
        if _kernels() is None:
            raise ValueError("backend='triton' needs Triton, which is not importable here")
        return True
    if not on_cuda or width > _MAX_TRITON_WIDTH:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # the kernels have no backward: training goes through the differentiable reference
    return _kernels() is not None


# --- validation ---------------------------------------------------------------------------------------------------


def _check_tokens(name: str, t: Tensor, width: int | None = None) -> tuple[int, int]:
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating [tokens, width] tensor, got {t.dtype} {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {t.stride()}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has width {t.shape[1]}, expected {width}")
    return t.shape[0], t.shape[1]


def _check_rows(name: str, rows: Tensor, width: int, device: torch.device) -> None:
    if rows.dim() != 2 or rows.shape[1] != width or not rows.is_floating_point():
        raise ValueError(f"{name} must be a floating [rows, {width}] tensor, got {rows.dtype} {tuple(rows.shape)}")
    if rows.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {rows.stride()}")
    if rows.device != device:
        raise ValueError(f"{name} is on {rows.device}, expected {device}")


def _check_row_ids(row_ids: Tensor, tokens: int, num_rows: int, device: torch.device) -> None:
    if row_ids.dim() != 1 or row_ids.shape[0] != tokens or row_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"row_ids must be an int32/int64 [{tokens}] tensor (one row per token), got {row_ids.dtype} "
            f"{tuple(row_ids.shape)}"
        )
    if row_ids.device != device:
        raise ValueError(f"row_ids is on {row_ids.device}, expected {device}")
    # Bounds are checked where reading the ids costs no device sync.
    if device.type == "cpu" and tokens and (int(row_ids.min()) < 0 or int(row_ids.max()) >= num_rows):
        raise ValueError(
            f"row_ids must lie in [0, {num_rows}), got values in [{int(row_ids.min())}, {int(row_ids.max())}]"
        )


def _check_modulated(x: Tensor, row_ids: Tensor, **rows: Tensor) -> tuple[int, int]:
    tokens, width = _check_tokens("x", x)
    num_rows = None
    for name, t in rows.items():
        _check_rows(name, t, width, x.device)
        if num_rows is not None and t.shape[0] != num_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {num_rows} like the other modulation tensors")
        num_rows = t.shape[0]
    _check_row_ids(row_ids, tokens, num_rows or 0, x.device)
    return tokens, width


# --- FP8 outputs --------------------------------------------------------------------------------------------------


def _fp8():
    """fp8_cache's quantization contract (imported on first FP8 use: the model itself needs no fp8_cache)."""
    import fp8_cache

    return fp8_cache


def wants_fp8_input(linear: torch.nn.Module, x: Tensor) -> bool:
    """True when ``linear`` is an ``fp8_cache.FP8Linear`` that runs FP8 GEMMs on ``x``'s device for ``x.dtype``.

    Then the op producing its input should quantize (``quantize=True``): per-token scales run the FP8 GEMM for
    bfloat16 activations. Elsewhere FP8Linear takes exact activations, and so do the producers.
    """
    fp8_cache = sys.modules.get("fp8_cache")  # a model holds an FP8Linear only once fp8_cache is imported
    if fp8_cache is None or not isinstance(linear, fp8_cache.FP8Linear):
        return False
    return x.dtype == torch.bfloat16 and fp8_cache.scaled_mm_available(x.device)


def _quantized_buffers(tokens: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    fp8 = _fp8()
    return (
        torch.empty(tokens, width, dtype=fp8.FP8_DTYPE, device=device),
        torch.empty(tokens, 1, dtype=torch.float32, device=device),
    )


def _quantize_reference(y: Tensor, dtype: torch.dtype) -> FP8Activation:
    from fp8_cache.quant import per_row_scales, quantize_with_scale

    scale = per_row_scales(y)
    return _fp8().FP8Activation(quantize_with_scale(y, scale), scale, dtype)


def _finish(y: Tensor, dtype: torch.dtype, quantize: bool) -> Tensor | FP8Activation:
    return _quantize_reference(y, dtype) if quantize else y.to(dtype)


# --- ops ------------------------------------------------------------------------------------------------------------


def _layer_norm_modulate_reference(x: Tensor, shift: Tensor, scale: Tensor, row_ids: Tensor, eps: float) -> Tensor:
    """float32 ``LayerNorm(x) * (1 + scale[row_ids]) + shift[row_ids]``."""
    normed = F.layer_norm(x.float(), (x.shape[1],), eps=eps)
    return normed * (1 + scale.index_select(0, row_ids).float()) + shift.index_select(0, row_ids).float()


def layer_norm_modulate(
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    row_ids: Tensor,
    *,
    eps: float,
    quantize: bool = False,
    backend: Backend = "auto",
) -> Tensor | FP8Activation:
    """``LayerNorm(x) * (1 + scale[row_ids]) + shift[row_ids]`` per token, in x's dtype or FP8 (``quantize``).

    x: ``[tokens, width]``; shift, scale: ``[rows, width]`` (any row stride); row_ids: int ``[tokens]``.
    """
    tokens, width = _check_modulated(x, row_ids, shift=shift, scale=scale)
    if not _use_triton(backend, (x, shift, scale), width):
        return _finish(_layer_norm_modulate_reference(x, shift, scale, row_ids, eps), x.dtype, quantize)
    fp8 = _fp8() if quantize else None
    if quantize:
        out, out_scale = _quantized_buffers(tokens, width, x.device)
    else:
        out, out_scale = torch.empty_like(x, memory_format=torch.contiguous_format), None
    if tokens:
        _kernels().layer_norm_modulate(
            x, shift, scale, row_ids, eps, out, out_scale, *(_contract() if quantize else (0.0, 0.0))
        )
    return fp8.FP8Activation(out, out_scale, x.dtype) if quantize else out


def _contract() -> tuple[float, float]:
    fp8 = _fp8()
    return fp8.FP8_MAX, fp8.MIN_SCALE


def gated_residual(
    residual: Tensor, gate: Tensor, branch: Tensor, row_ids: Tensor, *, backend: Backend = "auto"
) -> Tensor:
    """``residual + gate[row_ids] * branch`` in float32, rounded once to residual's dtype (a new tensor)."""
    tokens, width = _check_modulated(residual, row_ids, gate=gate)
    _check_tokens("branch", branch, width)
    if branch.shape[0] != tokens:
        raise ValueError(f"branch has {branch.shape[0]} tokens, residual {tokens}")
    if not _use_triton(backend, (residual, gate, branch), width):
        return _gated_residual_reference(residual, gate, branch, row_ids)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if tokens:
        _kernels().gated_residual(residual, gate, branch, row_ids, out, None, 0.0, 0.0)
    return out


def _gated_residual_reference(residual: Tensor, gate: Tensor, branch: Tensor, row_ids: Tensor) -> Tensor:
    return (residual.float() + gate.index_select(0, row_ids).float() * branch.float()).to(residual.dtype)


def gated_residual_layer_norm_modulate(
    residual: Tensor,
    gate: Tensor,
    branch: Tensor,
    shift: Tensor,
    scale: Tensor,
    row_ids: Tensor,
    *,
    eps: float,
    quantize: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | FP8Activation]:
    """``(r, layer_norm_modulate(r, shift, scale))`` with ``r = gated_residual(residual, gate, branch)``, one pass."""
    tokens, width = _check_modulated(residual, row_ids, gate=gate, shift=shift, scale=scale)
    _check_tokens("branch", branch, width)
    if branch.shape[0] != tokens:
        raise ValueError(f"branch has {branch.shape[0]} tokens, residual {tokens}")
    if not _use_triton(backend, (residual, gate, branch, shift, scale), width):
        updated = _gated_residual_reference(residual, gate, branch, row_ids)
        modulated = _layer_norm_modulate_reference(updated, shift, scale, row_ids, eps)
        return updated, _finish(modulated, residual.dtype, quantize)
    fp8 = _fp8() if quantize else None
    updated = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if quantize:
        out, out_scale = _quantized_buffers(tokens, width, residual.device)
    else:
        out, out_scale = torch.empty_like(updated), None
    if tokens:
        _kernels().gated_residual(
            residual,
            gate,
            branch,
            row_ids,
            updated,
            (shift, scale, eps, out, out_scale),
            *(_contract() if quantize else (0.0, 0.0)),
        )
    return updated, (fp8.FP8Activation(out, out_scale, residual.dtype) if quantize else out)


def gelu_quantize(x: Tensor, *, backend: Backend = "auto") -> FP8Activation:
    """tanh-GELU of ``x [tokens, width]`` quantized to FP8 with one scale per token (what an FP8 fc2 takes)."""
    tokens, width = _check_tokens("x", x)
    if not _use_triton(backend, (x,), width):
        return _quantize_reference(F.gelu(x.float(), approximate="tanh"), x.dtype)
    out, out_scale = _quantized_buffers(tokens, width, x.device)
    if tokens:
        _kernels().gelu_quantize(x, out, out_scale, *_contract())
    return _fp8().FP8Activation(out, out_scale, x.dtype)


def rms_norm(x: Tensor, weight: Tensor, *, eps: float, backend: Backend = "auto") -> Tensor:
    """RMS norm over the last dim times ``weight``, computed in float32, returned in x's dtype.

    Any shape ``[..., size]``; the kernel runs on ``[tokens, heads, size]`` tensors whose last dim is contiguous
    (the per-head QK norm of a flat batch, read straight from the packed QKV projection).
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    fits = x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] * x.shape[2] <= _MAX_TRITON_WIDTH
    if backend == "triton" and not fits:
        raise ValueError(
            f"the rms_norm kernel takes [tokens, heads, size] with stride(-1) == 1, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if not (fits and _use_triton(backend, (x, weight), x.shape[-1])):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (x32 * weight.float()).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _kernels().rms_norm_heads(x, weight, eps, out)
    return out


__all__ = [
    "Backend",
    "gated_residual",
    "gated_residual_layer_norm_modulate",
    "gelu_quantize",
    "layer_norm_modulate",
    "rms_norm",
    "triton_interpreter_active",
    "wants_fp8_input",
]
