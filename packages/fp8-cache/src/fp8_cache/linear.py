"""``FP8Linear`` and ``quantize_model``: swap eligible ``nn.Linear`` layers for per-tensor FP8 ones.

On a CUDA device with FP8 tensor cores (compute capability 8.9+, e.g. L4/H100/H200) the forward pass
quantizes the activation dynamically and runs ``torch._scaled_mm``: one scale per call by default, or one per
row (``quantize_model(..., activation_scaling="row")``, stored on each layer; one fused Triton kernel reads the
activation once and writes its FP8 copy and scales). An op that produces the activation can quantize it itself
and pass an :class:`FP8Activation`, so no separate quantization pass runs. Linears that read the same input
tensor (a block's Q, K and V projections) quantize it once: the last quantized input is remembered by identity
and version counter (``quantized_input``), eager only. Everywhere else the layer dequantizes and runs an ordinary
matmul, so results agree within FP8 error.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from fp8_cache.quant import (
    FP8_DTYPE,
    dequantize,
    per_row_scales,
    per_tensor_scale,
    quantize_with_scale,
    require_finite_scales,
)

logger = logging.getLogger(__name__)

# torch._scaled_mm needs both GEMM dimensions of the weight to be multiples of 16.
SCALED_MM_ALIGNMENT = 16
# How FP8Linear scales a high-precision input it quantizes itself: one scale per call, or one per row.
ActivationScaling = Literal["tensor", "row"]
_SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _cuda_supports_fp8_gemm(device_index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_available(device: torch.device) -> bool:
    """True when ``torch._scaled_mm`` can run per-tensor FP8 GEMMs on ``device``."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_supports_fp8_gemm(index)


@functools.lru_cache(maxsize=1)
def _triton_quantizer():
    try:
        from fp8_cache._triton_quant import quantize_activation_triton
    except ImportError:  # a CUDA torch without Triton: fall back to the (slower) torch expression
        logger.warning("Triton is not importable; FP8Linear quantizes activations with plain torch ops")
        return None
    return quantize_activation_triton


@dataclass(frozen=True)
class FP8Activation:
    """An activation already quantized by the op that produced it, ready for :class:`FP8Linear`.

    ``data``: ``float8_e4m3fn`` ``[..., in_features]``, contiguous. ``scale``: float32, either 0-dim (one scale
    for the whole tensor) or ``[rows, 1]`` with ``rows = data.numel() // data.shape[-1]`` (one scale per row).
    ``dtype``: the floating dtype the activation had, which the linear's output takes. The library's contract
    holds for each scale group: ``scale = max(amax / FP8_MAX, MIN_SCALE)``, ``data = fp8(clamp(x / scale))``,
    so ``data * scale`` approximates the activation within one FP8 rounding step.
    """

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE:
            raise TypeError(f"FP8Activation.data must be {FP8_DTYPE}, got {self.data.dtype}")
        if self.data.dim() < 1 or not self.data.is_contiguous():
            raise ValueError(
                f"FP8Activation.data must be a contiguous tensor of rank >= 1, got {tuple(self.data.shape)}"
            )
        if self.scale.dtype != torch.float32 or self.scale.device != self.data.device:
            raise ValueError(
                f"FP8Activation.scale must be float32 on {self.data.device}, "
                f"got {self.scale.dtype} on {self.scale.device}"
            )
        width = self.data.shape[-1]
        rows = self.data.numel() // width if width else 0
        if self.scale.dim() != 0 and tuple(self.scale.shape) != (rows, 1):
            raise ValueError(
                f"FP8Activation.scale must be 0-dim or [{rows}, 1] (one per row of data {tuple(self.data.shape)}), "
                f"got {tuple(self.scale.shape)}"
            )
        if not self.dtype.is_floating_point or self.dtype == FP8_DTYPE:
            raise ValueError(f"FP8Activation.dtype must be a high-precision floating dtype, got {self.dtype}")

    @classmethod
    def _unchecked(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> FP8Activation:
        """This library's own quantizers' results, which meet the contract by construction: skip the checks (a
        few microseconds of host time per linear, which the eager path cannot spare)."""
        activation = object.__new__(cls)
        object.__setattr__(activation, "data", data)
        object.__setattr__(activation, "scale", scale)
        object.__setattr__(activation, "dtype", dtype)
        return activation

    @property
    def per_row(self) -> bool:
        return self.scale.dim() == 2

    def dequantize(self) -> torch.Tensor:
        """``data * scale`` in float32, returned in ``dtype`` with ``data``'s shape."""
        width = self.data.shape[-1]
        values = self.data.reshape(-1, width).to(torch.float32) * self.scale
        return values.reshape(self.data.shape).to(self.dtype)


def quantize_activation_rows(x: torch.Tensor) -> FP8Activation:
    """Dynamic per-row FP8 quantization of ``x [..., width]``: one scale per row (the leading dims flattened).

    On CUDA one Triton pass (the row is read from memory once); elsewhere, and under ``torch.compile`` (where
    inductor fuses it into the op that produced ``x``), the exact torch expression. Scales
    agree exactly; the CUDA pass multiplies by the scale's reciprocal, so a value within a float32 rounding of
    an FP8 rounding boundary may land one FP8 step away.
    """
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(
            f"quantize_activation_rows needs a floating tensor of rank >= 1, got {x.dtype} {tuple(x.shape)}"
        )
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    kernel = _triton_row_quantizer() if x.is_cuda and not torch.compiler.is_compiling() else None
    if kernel is not None:
        data, scale = kernel(x2d)
    else:
        scale = per_row_scales(x2d)
        data = quantize_with_scale(x2d, scale)
    return FP8Activation._unchecked(data.reshape(x.shape), scale, x.dtype)


@functools.lru_cache(maxsize=1)
def _triton_row_quantizer():
    try:
        from fp8_cache._triton_quant import quantize_rows_triton
    except ImportError:
        logger.warning("Triton is not importable; per-row FP8 activation quantization uses plain torch ops")
        return None
    return quantize_rows_triton


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor FP8 quantization of an activation: ``(contiguous x_fp8, float32 0-dim scale)``.

    On CUDA this is two Triton passes with no host synchronisation; elsewhere, and under ``torch.compile``
    (where inductor fuses the expression into the op that produced ``x``), the exact torch expression.
    """
    x = x.contiguous()
    kernel = _triton_quantizer() if x.is_cuda and not torch.compiler.is_compiling() else None
    if kernel is not None:
        return kernel(x)
    scale = per_tensor_scale(x)
    return quantize_with_scale(x, scale), scale


_LAST_INPUT = threading.local()


def quantized_input(x: torch.Tensor, activation_scaling: ActivationScaling) -> FP8Activation:
    """``x`` quantized for an FP8 GEMM (per row or per tensor), reusing the previous call's result when it was
    for this same tensor object, unmodified since (its version counter), with the same scaling.

    One entry per thread, held through a weak reference to ``x``: nothing keeps ``x`` alive, and the entry holds
    only the last FP8 copy. Under ``torch.compile`` nothing is remembered (inductor removes the repeated
    quantization itself); inference-mode tensors, which have no version counter, are never reused.
    """
    compiling = torch.compiler.is_compiling()
    version = None
    if not compiling:
        try:
            version = x._version
        except RuntimeError:  # an inference tensor
            version = None
        last = getattr(_LAST_INPUT, "entry", None)
        if last is not None and version is not None:
            ref, last_version, scaling, activation = last
            if ref() is x and last_version == version and scaling == activation_scaling:
                return activation
    if activation_scaling == "row":
        activation = quantize_activation_rows(x)
    else:
        x_fp8, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        activation = FP8Activation._unchecked(x_fp8.reshape(x.shape), x_scale, x.dtype)
    if version is not None:
        _LAST_INPUT.entry = (weakref.ref(x), version, activation_scaling, activation)
    return activation


def _gemm_shape_reason(in_features: int, out_features: int) -> str | None:
    for label, size in (("in_features", in_features), ("out_features", out_features)):
        if size % SCALED_MM_ALIGNMENT:
            return f"{label}={size} is not a multiple of {SCALED_MM_ALIGNMENT} (torch._scaled_mm requirement)"
    return None


def ineligible_weight_reason(shape: Sequence[int], dtype: torch.dtype) -> str | None:
    """Why a weight of this shape and dtype cannot become an FP8 linear weight, or None if it can.

    The one eligibility rule of this library (``quantize_model``, ``fp8_weight_names`` and the cache's
    ``select_quantized`` all apply it): a 2-D ``[out_features, in_features]`` weight in a high-precision floating
    dtype whose both dims are multiples of 16.
    """
    if len(shape) != 2:
        return f"weight is {len(shape)}-D; FP8 linears need a 2-D weight"
    if not dtype.is_floating_point or dtype.itemsize == 1:
        return f"weight dtype {dtype} is not a high-precision floating type"
    out_features, in_features = shape
    return _gemm_shape_reason(in_features, out_features)


class FP8Linear(nn.Module):
    """A linear layer holding a per-tensor ``float8_e4m3fn`` weight ``[out, in]`` and a float32 scale.

    State dict: ``weight`` (fp8, row-major ``[out_features, in_features]``), ``weight_scale`` (float32,
    0-dim) and optionally ``bias`` (kept in high precision). A fused projection (several logical output
    widths in one weight, ``logical_widths``) shares the single scale; no per-shard requantization happens.
    Parameters never require grad: this is an inference module.

    ``forward`` takes a high-precision tensor, quantized here (``activation_scaling``, this layer's own:
    ``"tensor"``, one dynamic scale per call in two passes, or ``"row"``, one scale per row in one pass), or an
    :class:`FP8Activation` quantized by the op that produced it. Per-row scales run the FP8 GEMM for bfloat16
    outputs; other output dtypes with per-row scales take the dequantized path.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
        logical_widths: Sequence[int] | None = None,
        activation_scaling: ActivationScaling = "tensor",
    ) -> None:
        super().__init__()
        reason = _gemm_shape_reason(in_features, out_features)
        if reason is not None:
            raise ValueError(f"FP8Linear cannot hold this weight: {reason}; keep this layer as nn.Linear")
        if logical_widths is not None and sum(logical_widths) != out_features:
            raise ValueError(f"logical_widths {list(logical_widths)} must sum to out_features={out_features}")
        _check_activation_scaling(activation_scaling)
        self.activation_scaling = activation_scaling
        self.in_features = in_features
        self.out_features = out_features
        self.logical_widths = tuple(logical_widths) if logical_widths is not None else (out_features,)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.ones((), dtype=torch.float32, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        scale: torch.Tensor | None = None,
        name: str = "linear",
        activation_scaling: ActivationScaling = "tensor",
    ) -> FP8Linear:
        """Quantize ``linear``'s weight on its current device.

        ``scale`` may be precomputed with ``per_tensor_scale`` (and checked by the caller); otherwise it is
        computed here and a NaN/inf weight raises ``NonFiniteWeightError``.
        """
        bias = linear.bias
        module = cls(
            linear.in_features,
            linear.out_features,
            bias is not None,
            device="meta",
            bias_dtype=bias.dtype if bias is not None else torch.bfloat16,
            logical_widths=getattr(linear, "logical_widths", None),
            activation_scaling=activation_scaling,
        )
        weight = linear.weight.detach()
        if scale is None:
            scale = per_tensor_scale(weight)
            require_finite_scales({name: scale})
        module.weight = nn.Parameter(quantize_with_scale(weight, scale), requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return module

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"activation_scaling={self.activation_scaling!r}"
        )

    def forward(self, x: torch.Tensor | FP8Activation) -> torch.Tensor:
        if isinstance(x, FP8Activation):
            return self._forward_fp8(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expected last dim {self.in_features}, got input of shape {tuple(x.shape)}")
        if scaled_mm_available(x.device) and x.dtype in _SCALED_MM_OUT_DTYPES:
            if x.numel() == 0:
                return x.new_empty(*x.shape[:-1], self.out_features)
            scaling = "row" if self.activation_scaling == "row" and x.dtype == torch.bfloat16 else "tensor"
            return self._forward_fp8(quantized_input(x, scaling))
        weight = dequantize(self.weight, self.weight_scale, x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, weight, bias)

    def _weight_scale_row(self) -> torch.Tensor:
        """The weight's scale as a contiguous ``[1, out_features]`` row, as rowwise ``_scaled_mm`` requires.

        Memoized on the scale tensor's identity, storage and version counter, so replacing or updating the scale
        (``load_state_dict``, with or without ``assign``) recomputes it; inference tensors, which keep no version
        counter, recompute it on every call.
        """
        scale = self.weight_scale
        if torch.compiler.is_compiling():  # a graph computes it once per call; a memo would only add guards
            return scale.detach().reshape(1, 1).expand(1, self.out_features).contiguous()
        try:
            key = (id(scale), scale.data_ptr(), scale._version)
        except RuntimeError:  # an inference tensor
            key = None
        cached = self.__dict__.get("_scale_row_memo")
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        row = scale.detach().reshape(1, 1).expand(1, self.out_features).contiguous()
        if key is not None:
            self.__dict__["_scale_row_memo"] = (key, row)
        return row

    def _forward_fp8(self, x: FP8Activation) -> torch.Tensor:
        data = x.data
        if data.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expected last dim {self.in_features}, got input of shape {tuple(data.shape)}")
        leading = data.shape[:-1]
        out_dtype = x.dtype
        x2d = data.reshape(-1, self.in_features)
        if x2d.shape[0] == 0:
            return torch.empty(*leading, self.out_features, dtype=out_dtype, device=data.device)
        gemm_ok = out_dtype == torch.bfloat16 if x.per_row else out_dtype in _SCALED_MM_OUT_DTYPES
        if not (gemm_ok and scaled_mm_available(data.device)):
            weight = dequantize(self.weight, self.weight_scale, out_dtype)
            bias = self.bias.to(out_dtype) if self.bias is not None else None
            return F.linear(x.dequantize(), weight, bias)
        weight_scale = self._weight_scale_row() if x.per_row else self.weight_scale
        # _scaled_mm fuses the bias only for half-precision outputs with a bias of the same dtype.
        fuse_bias = self.bias is not None and out_dtype != torch.float32 and self.bias.dtype == out_dtype
        out = torch._scaled_mm(
            x2d,
            self.weight.t(),  # column-major view of the row-major [out, in] weight, as _scaled_mm requires
            scale_a=x.scale,
            scale_b=weight_scale,
            bias=self.bias if fuse_bias else None,
            out_dtype=out_dtype,
        )
        if self.bias is not None and not fuse_bias:
            out = out + self.bias.to(out_dtype)
        return out.reshape(*leading, self.out_features)


@dataclass
class QuantizationReport:
    """What ``quantize_model`` did: swapped module names, and kept modules with the reason."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def quantized_weight_names(self) -> list[str]:
        """State-dict names of the FP8 weights (what an FP8 cache must hold quantized)."""
        return [f"{name}.weight" for name in self.quantized]


def _ignored(name: str, patterns: Sequence[str]) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _select_linears(
    model: nn.Module, ignore: Sequence[str], *, names_only: bool = False
) -> tuple[list[tuple[str, nn.Linear]], dict[str, str]]:
    """(the ``nn.Linear`` layers FP8 applies to, {kept layer: reason}): the one eligibility rule of this library.

    ``names_only``: the caller wants names, not weights, so a weight on the meta device counts as it will once
    loaded (a model built on the meta device names the weights its loaded form would quantize)."""
    if isinstance(ignore, str):
        raise TypeError("ignore must be a sequence of fnmatch patterns, not a single string; wrap it in a list")
    candidates: list[tuple[str, nn.Linear]] = []
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        pattern = _ignored(name, ignore)
        if pattern is not None:
            skipped[name] = f"matches ignore pattern {pattern!r}"
        elif (reason := ineligible_weight_reason(module.weight.shape, module.weight.dtype)) is not None:
            skipped[name] = reason
        elif module.weight.device.type == "meta" and not names_only:
            skipped[name] = "weight is on the meta device; load weights before quantizing"
        else:
            candidates.append((name, module))
    return candidates, skipped


def fp8_weight_names(model: nn.Module, *, ignore: Sequence[str] = ()) -> list[str]:
    """State-dict names of the weights :func:`quantize_model` would make FP8, without changing ``model``.

    Pass them as ``quantize=`` to :func:`load_fp8_weights` so a cache holds exactly what online quantization
    would produce (a name pattern alone would also match, say, an embedding table). Works on a model built on the
    meta device (shapes and dtypes decide, not values), so a loader can ask before reading any weight.
    """
    candidates, _ = _select_linears(model, ignore, names_only=True)
    return [f"{name}.weight" for name, _ in candidates]


def _check_activation_scaling(activation_scaling: object) -> None:
    if activation_scaling not in get_args(ActivationScaling):
        raise ValueError(
            f"activation_scaling must be one of {list(get_args(ActivationScaling))}, got {activation_scaling!r}"
        )


def quantize_model(
    model: nn.Module, *, ignore: Sequence[str] = (), activation_scaling: ActivationScaling = "tensor"
) -> QuantizationReport:
    """Swap every eligible ``nn.Linear`` of ``model`` for an :class:`FP8Linear`, in place.

    A linear is kept in high precision (and logged with the reason) when its fully qualified name matches an
    ``ignore`` pattern (``fnmatch``), its shape cannot run through ``torch._scaled_mm``, or its weight is not
    materialized (meta device). Weights are quantized on the device they live on. ``activation_scaling`` is how
    every swapped layer quantizes a high-precision input on the FP8 GEMM path (``"tensor"``: one scale per call;
    ``"row"``: one per row), stored on each layer. Raises ``NonFiniteWeightError`` (before changing anything) if an
    eligible weight holds NaN or infinity.
    """
    _check_activation_scaling(activation_scaling)
    candidates, skipped = _select_linears(model, ignore)
    report = QuantizationReport(skipped=skipped)
    scales = {name: per_tensor_scale(module.weight.detach()) for name, module in candidates}
    require_finite_scales(scales)
    for name, module in candidates:
        fp8 = FP8Linear.from_linear(module, scale=scales[name], name=name, activation_scaling=activation_scaling)
        _set_submodule(model, name, fp8)
        report.quantized.append(name)
    for name, reason in report.skipped.items():
        logger.info("keeping %s in high precision: %s", name, reason)
    return report


def load_fp8_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, activation_scaling: ActivationScaling = "tensor"
) -> QuantizationReport:
    """Install an FP8 runtime state dict (e.g. a cache hit) into ``model`` without quantizing anything.

    Every ``nn.Linear`` whose ``<name>.weight`` in ``state_dict`` is FP8 (with ``<name>.weight_scale``) becomes
    an :class:`FP8Linear` (with ``activation_scaling``, as :func:`quantize_model`); then the whole state dict is
    assigned (``strict``; a model built on the meta device is materialized directly on the tensors' device). FP8
    weights and their scales are used as given; a high-precision tensor takes the dtype of the parameter or buffer
    it replaces, so installing a checkpoint stored in another dtype never changes the model's compute dtype.
    Raises ``ValueError`` naming the layer, before changing the model, if an FP8 weight has no scale or does not fit
    its layer.
    """
    _check_activation_scaling(activation_scaling)
    model_dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    state_dict = {
        name: tensor.to(model_dtypes[name])
        # FP8 tensors, and names the model lacks (checked by load_state_dict below), are kept as given.
        if tensor.is_floating_point() and FP8_DTYPE not in (tensor.dtype, model_dtypes.get(name, FP8_DTYPE))
        else tensor
        for name, tensor in state_dict.items()
    }
    report = QuantizationReport()
    swaps: list[tuple[str, FP8Linear]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, FP8Linear):
            continue
        weight = state_dict.get(f"{name}.weight")
        if weight is None or weight.dtype != FP8_DTYPE:
            report.skipped[name] = "state dict holds a high-precision weight"
            continue
        if f"{name}.weight_scale" not in state_dict:
            raise ValueError(f"FP8 weight {name}.weight has no {name}.weight_scale in the state dict")
        if tuple(weight.shape) != (module.out_features, module.in_features):
            raise ValueError(
                f"FP8 weight {name}.weight has shape {tuple(weight.shape)}, layer expects "
                f"({module.out_features}, {module.in_features})"
            )
        bias = module.bias
        swaps.append(
            (
                name,
                FP8Linear(
                    module.in_features,
                    module.out_features,
                    bias is not None,
                    device="meta",
                    bias_dtype=bias.dtype if bias is not None else torch.bfloat16,
                    logical_widths=getattr(module, "logical_widths", None),
                    activation_scaling=activation_scaling,
                ),
            )
        )
    for name, fp8 in swaps:
        _set_submodule(model, name, fp8)
        report.quantized.append(name)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return report
