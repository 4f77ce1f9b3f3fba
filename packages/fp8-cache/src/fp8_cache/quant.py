"""Per-tensor ``float8_e4m3fn`` quantization: the one numeric contract every other module relies on.

Invariants:
- ``scale = max(amax(|W|) / FP8_MAX, MIN_SCALE)`` in float32, so an all-zero tensor gets a finite, non-zero
  scale and dequantization never divides by zero.
- ``W_q = cast_fp8(clamp(W / scale, -FP8_MAX, FP8_MAX))`` and ``W ~= W_q * scale``.
- The result depends only on the tensor's values: quantizing the same weight on the same kind of device gives
  the same bytes, which is what makes a cached artifact bit-identical to online quantization.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Smallest scale we hand out; keeps all-zero tensors finite (the convention of the common FP8 kernels).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


class NonFiniteWeightError(ValueError):
    """A tensor holds NaN or infinity, so it has no meaningful per-tensor FP8 scale."""


def per_tensor_scale(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 0-dim scale of ``tensor`` on its own device (NaN if the tensor holds NaN or inf).

    One reduction kernel, no host synchronisation: callers that quantize many tensors check finiteness once
    at the end with :func:`require_finite_scales`.
    """
    if not tensor.is_floating_point():
        raise TypeError(f"FP8 quantization needs a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.numel() == 0:
        return torch.full((), MIN_SCALE, dtype=torch.float32, device=tensor.device)
    # The inf-norm is a max, exact in the input dtype: one reduction pass, no float32 copy of the tensor.
    amax = torch.linalg.vector_norm(tensor, ord=float("inf")).to(torch.float32)
    return torch.clamp(amax / FP8_MAX, min=MIN_SCALE)


def quantize_with_scale(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``cast_fp8(clamp(tensor / scale))`` in float32 arithmetic; same shape and device as ``tensor``."""
    scaled = tensor.to(torch.float32) / scale
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def require_finite_scales(named_scales: dict[str, torch.Tensor]) -> None:
    """Raise :class:`NonFiniteWeightError` naming every tensor whose scale is not finite (one host sync)."""
    if not named_scales:
        return
    names = list(named_scales)
    finite = torch.isfinite(torch.stack([named_scales[n].reshape(()).float() for n in names])).cpu()
    bad = [name for name, ok in zip(names, finite.tolist(), strict=True) if not ok]
    if bad:
        raise NonFiniteWeightError(
            f"cannot quantize tensors holding NaN or infinity: {bad}; fix the checkpoint or exclude them "
            "from FP8 quantization (ignore=...)"
        )


def quantize_per_tensor(tensor: torch.Tensor, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``tensor`` to ``(fp8 tensor, float32 0-dim scale)`` on its device; rejects NaN/inf values."""
    scale = per_tensor_scale(tensor)
    require_finite_scales({name: scale})
    return quantize_with_scale(tensor, scale), scale


def per_row_scales(tensor: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, 1]`` scales of a 2-D tensor, one per row, by the same rule as :func:`per_tensor_scale`.

    ``scale[r] = max(amax(|tensor[r]|) / FP8_MAX, MIN_SCALE)``. Used for activations (no finiteness check).
    """
    if tensor.dim() != 2:
        raise ValueError(f"per_row_scales expects a 2-D tensor, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"FP8 quantization needs a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.shape[1] == 0:
        return torch.full((tensor.shape[0], 1), MIN_SCALE, dtype=torch.float32, device=tensor.device)
    amax = tensor.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return torch.clamp(amax / FP8_MAX, min=MIN_SCALE)


def dequantize(qtensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qtensor * scale`` computed in float32, returned as ``dtype``."""
    if qtensor.dtype != FP8_DTYPE:
        raise TypeError(f"dequantize expects a {FP8_DTYPE} tensor, got {qtensor.dtype}")
    return (qtensor.to(torch.float32) * scale.to(torch.float32)).to(dtype)
