"""Per-tensor FP8 math, FP8Linear parity against a float64 reference, and quantize_model."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fp8_cache import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    FP8Activation,
    FP8Linear,
    NonFiniteWeightError,
    dequantize,
    fp8_weight_names,
    load_fp8_state_dict,
    per_row_scales,
    per_tensor_scale,
    quantize_activation,
    quantize_activation_rows,
    quantize_model,
    quantize_per_tensor,
    scaled_mm_available,
)

# float8_e4m3fn has 3 mantissa bits: round-to-nearest relative error <= 2^-4 for normal values.
FP8_REL_STEP = 2.0**-4


def test_scale_is_amax_over_fp8_max_and_extremes_map_to_fp8_max():
    w = torch.tensor([[0.5, -3.0], [1.25, 2.0]], dtype=torch.bfloat16)
    q, scale = quantize_per_tensor(w)
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert torch.equal(scale, torch.tensor(3.0, dtype=torch.float32) / FP8_MAX)
    assert q.dtype == FP8_DTYPE
    assert q.float()[0, 1].item() == -FP8_MAX


def test_all_zero_tensor_gets_the_minimum_scale_and_round_trips_to_zero():
    q, scale = quantize_per_tensor(torch.zeros(16, 16))
    assert scale.item() == pytest.approx(MIN_SCALE)
    assert torch.count_nonzero(dequantize(q, scale)) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_rejected_with_the_tensor_name(bad):
    w = torch.ones(4, 4)
    w[1, 2] = bad
    with pytest.raises(NonFiniteWeightError, match="blocks.0.proj"):
        quantize_per_tensor(w, name="blocks.0.proj")


def test_integer_tensor_is_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        per_tensor_scale(torch.ones(4, dtype=torch.int32))


def test_dequantized_weight_is_within_one_fp8_rounding_step():
    torch.manual_seed(0)
    w = torch.randn(64, 48, dtype=torch.float64)
    q, scale = quantize_per_tensor(w.to(torch.bfloat16))
    w_bf16 = w.to(torch.bfloat16).double()
    err = (dequantize(q, scale, torch.float64) - w_bf16).abs()
    # Normal range: relative rounding; subnormal range (|w|/scale < 2^-6): absolute step of 2^-9 * scale.
    bound = torch.maximum(w_bf16.abs() * FP8_REL_STEP, torch.full_like(w_bf16, 2.0**-10 * scale.item()))
    assert bool((err <= bound * 1.0001).all())


def test_quantization_is_deterministic_bytewise():
    w = torch.randn(128, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    (q1, s1), (q2, s2) = quantize_per_tensor(w), quantize_per_tensor(w.clone())
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float64_reference_within_fp8_error(bias, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=bias)
    x = torch.randn(5, 7, 64)
    fp8 = FP8Linear.from_linear(linear)
    out = fp8(x.to(dtype))
    assert out.shape == (5, 7, 32) and out.dtype == dtype

    ref = x.double() @ linear.weight.double().t()
    if bias:
        ref = ref + linear.bias.double()
    # Each product carries at most one FP8 rounding of the weight (activations stay exact on the CPU path).
    bound = (x.double().abs() @ linear.weight.double().abs().t()) * FP8_REL_STEP + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8 + (x.double().abs() @ linear.weight.double().abs().t()) * 2.0**-8
    assert bool(((out.double() - ref).abs() <= bound).all())
    # And the error is genuinely FP8-sized, not zero: the weight really is quantized.
    assert not torch.equal(out.double(), ref)


def test_fp8_linear_rejects_unaligned_shapes_and_wrong_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        FP8Linear(24, 32)
    with pytest.raises(ValueError, match="logical_widths"):
        FP8Linear(32, 32, logical_widths=[16, 8])
    layer = FP8Linear(32, 16)
    with pytest.raises(ValueError, match="last dim 32"):
        layer(torch.randn(2, 31))


def test_per_row_quantization_gives_each_row_its_own_scale():
    x = torch.tensor([[0.5, -3.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.25, -1.0]], dtype=torch.bfloat16)
    act = quantize_activation_rows(x)
    assert act.per_row and act.dtype == torch.bfloat16 and act.data.shape == (3, 3)
    expected = torch.tensor([[3.0], [MIN_SCALE * FP8_MAX], [2.0]], dtype=torch.float32) / FP8_MAX
    assert torch.equal(act.scale, expected) and torch.equal(per_row_scales(x), expected)
    assert act.data.float()[0, 1].item() == -FP8_MAX and act.data.float()[2, 0].item() == FP8_MAX
    assert torch.count_nonzero(act.data.float()[1]) == 0
    torch.testing.assert_close(act.dequantize(), x, rtol=2.0**-4, atol=0)
    leading = quantize_activation_rows(torch.randn(2, 3, 32))
    assert leading.data.shape == (2, 3, 32) and leading.scale.shape == (6, 1)


def test_fp8_activation_rejects_what_fp8_linear_could_not_consume():
    data = torch.zeros(4, 32, dtype=FP8_DTYPE)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        FP8Activation(torch.zeros(4, 32), torch.ones(()), torch.bfloat16)
    with pytest.raises(ValueError, match=r"0-dim or \[4, 1\]"):
        FP8Activation(data, torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        FP8Activation(data, torch.ones((), dtype=torch.float64), torch.bfloat16)
    with pytest.raises(ValueError, match="high-precision"):
        FP8Activation(data, torch.ones(()), torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        FP8Activation(torch.zeros(32, 4, dtype=FP8_DTYPE).t(), torch.ones(()), torch.bfloat16)
    layer = FP8Linear(64, 16)
    with pytest.raises(ValueError, match="last dim 64"):
        layer(FP8Activation(data, torch.ones(()), torch.bfloat16))


@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_linear_takes_a_pre_quantized_activation(per_row):
    """The product of the stored FP8 values: equal to running the layer on the dequantized activation."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    fp8 = FP8Linear.from_linear(linear)
    x = torch.randn(3, 5, 64)
    if per_row:
        act = quantize_activation_rows(x)
    else:
        q, scale = quantize_per_tensor(x)
        act = FP8Activation(q, scale, torch.float32)
    out = fp8(act)
    assert out.shape == (3, 5, 32) and out.dtype == torch.float32
    torch.testing.assert_close(out, fp8(act.dequantize()), rtol=0, atol=0)
    ref = x.double() @ linear.weight.double().t() + linear.bias.double()
    bound = (x.double().abs() @ linear.weight.double().abs().t()) * 2 * FP8_REL_STEP + 1e-6
    assert bool(((out.double() - ref).abs() <= bound).all())
    empty = fp8(quantize_activation_rows(torch.randn(0, 64)))
    assert empty.shape == (0, 32)


def test_the_weight_scale_row_follows_every_change_of_the_scale():
    """Rowwise GEMMs read the scale as a memoized [1, out] row: loading a new scale, in place or assigned, refreshes
    it."""
    layer = FP8Linear.from_linear(nn.Linear(32, 16))
    first = layer._weight_scale_row()
    assert first.shape == (1, 16) and first.is_contiguous() and layer._weight_scale_row() is first
    state = layer.state_dict()
    state["weight_scale"] = state["weight_scale"] * 2
    layer.load_state_dict(state)  # in place
    assert torch.equal(layer._weight_scale_row(), first * 2)
    state["weight_scale"] = state["weight_scale"] * 2
    layer.load_state_dict(state, assign=True)
    assert torch.equal(layer._weight_scale_row(), first * 4)


def test_fp8_linear_state_dict_layout():
    layer = FP8Linear.from_linear(nn.Linear(32, 48))
    sd = layer.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert sd["weight"].dtype == FP8_DTYPE and sd["weight"].shape == (48, 32)
    assert sd["weight_scale"].dtype == torch.float32 and sd["weight_scale"].dim() == 0
    assert not any(p.requires_grad for p in layer.parameters())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.qkv.logical_widths = [32, 32, 32]
        self.proj = nn.Linear(32, 32)
        self.odd = nn.Linear(32, 20)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(32, 16)


def test_quantize_model_swaps_eligible_linears_and_logs_the_rest(caplog):
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(3, 32)
    before = model.blocks[0].qkv(x)
    with caplog.at_level(logging.INFO, logger="fp8_cache.linear"):
        report = quantize_model(model, ignore=["head", "blocks.1.*"])
    assert report.quantized == ["blocks.0.qkv", "blocks.0.proj"]
    assert report.quantized_weight_names == ["blocks.0.qkv.weight", "blocks.0.proj.weight"]
    assert set(report.skipped) == {"blocks.0.odd", "blocks.1.qkv", "blocks.1.proj", "blocks.1.odd", "head"}
    assert "multiple of 16" in report.skipped["blocks.0.odd"]
    assert "ignore pattern 'blocks.1.*'" in report.skipped["blocks.1.qkv"]
    assert "blocks.0.odd" in caplog.text and "multiple of 16" in caplog.text
    assert isinstance(model.blocks[0].qkv, FP8Linear) and type(model.blocks[1].qkv) is nn.Linear
    # A fused projection keeps its logical widths and one scale for all of them.
    fused = model.blocks[0].qkv
    assert fused.logical_widths == (32, 32, 32) and fused.weight_scale.numel() == 1
    assert torch.allclose(fused(x), before, rtol=0.1, atol=0.05)


def test_quantize_model_with_non_finite_weight_changes_nothing():
    model = _Model()
    with torch.no_grad():
        model.blocks[1].proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="blocks.1.proj"):
        quantize_model(model)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


def test_quantize_model_skips_meta_weights_and_rejects_a_bare_string():
    with torch.device("meta"):
        model = _Model()
    report = quantize_model(model)
    assert report.quantized == [] and "meta device" in report.skipped["blocks.0.qkv"]
    with pytest.raises(TypeError, match="sequence of fnmatch patterns"):
        quantize_model(_Model(), ignore="head")


def test_activation_scaling_is_each_quantized_models_own():
    """Two models quantized with different activation scalings coexist: each layer keeps the one it was given."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    per_tensor = _Model().to(device, torch.bfloat16)
    per_row = _Model().to(device, torch.bfloat16)
    per_row.load_state_dict(per_tensor.state_dict())
    quantize_model(per_tensor)
    quantize_model(per_row, activation_scaling="row")
    layers = [(a, b) for a, b in zip(per_tensor.modules(), per_row.modules(), strict=True) if isinstance(a, FP8Linear)]
    assert layers and all(a.activation_scaling == "tensor" and b.activation_scaling == "row" for a, b in layers)
    assert "activation_scaling='row'" in repr(per_row.blocks[0].proj)
    installed = _Model().to(device, torch.bfloat16)
    load_fp8_state_dict(installed, per_row.state_dict(), activation_scaling="row")  # a cache hit takes it too
    assert installed.blocks[0].proj.activation_scaling == "row"
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    tensor_layer, row_layer = per_tensor.blocks[0].proj, per_row.blocks[0].proj
    if scaled_mm_available(x.device):  # the FP8 GEMM path: each layer quantizes its input its own way
        x_fp8, x_scale = quantize_activation(x)
        assert torch.equal(tensor_layer(x), tensor_layer(FP8Activation(x_fp8, x_scale, x.dtype)))
        assert torch.equal(row_layer(x), row_layer(quantize_activation_rows(x)))
        assert not torch.equal(tensor_layer(x), row_layer(x))
    else:  # elsewhere the dequantized path runs, whatever the scaling
        assert torch.equal(tensor_layer(x), row_layer(x))


def test_an_unknown_activation_scaling_is_refused_before_anything_changes():
    model = _Model()
    with pytest.raises(ValueError, match=r"activation_scaling must be one of \['tensor', 'row'\], got 'column'"):
        quantize_model(model, activation_scaling="column")
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    with pytest.raises(ValueError, match="activation_scaling must be one of"):
        FP8Linear(32, 32, activation_scaling="column")


class _Mixed(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32, dtype=dtype)  # 2-D "weight", but no linear: never FP8
        self.up = nn.Linear(32, 64, dtype=dtype)
        self.odd = nn.Linear(32, 20, dtype=dtype)  # 20 is not a multiple of 16: stays high precision
        self.head = nn.Linear(64, 32, dtype=dtype)


def test_fp8_weight_names_are_what_quantize_model_swaps_and_change_nothing():
    torch.manual_seed(0)
    model = _Mixed(torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    names = fp8_weight_names(model, ignore=["head"])
    assert names == ["up.weight"]
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any(isinstance(module, FP8Linear) for module in model.modules())
    assert quantize_model(model, ignore=["head"]).quantized_weight_names == names


def test_fp8_weight_names_of_a_meta_model_are_those_of_its_loaded_form():
    with torch.device("meta"):
        model = _Mixed(torch.float32)
    assert fp8_weight_names(model, ignore=["head"]) == ["up.weight"]
    assert quantize_model(model, ignore=["head"]).quantized == []  # quantizing still needs loaded weights


def test_installing_a_state_dict_of_another_dtype_keeps_the_model_dtype():
    torch.manual_seed(0)
    source = _Mixed(torch.bfloat16)  # e.g. a bf16 checkpoint
    quantize_model(source, ignore=["head"])
    target = _Mixed(torch.float32)  # a model that computes in fp32
    report = load_fp8_state_dict(target, source.state_dict())
    assert report.quantized == ["up"]
    assert target.up.weight.dtype == FP8_DTYPE and target.up.weight_scale.dtype == torch.float32
    assert torch.equal(target.up.weight.view(torch.uint8), source.up.weight.view(torch.uint8))
    for name in ("embed.weight", "odd.weight", "head.weight", "head.bias", "up.bias"):
        assert target.get_parameter(name).dtype == torch.float32, name
        assert torch.equal(target.get_parameter(name), source.get_parameter(name).float()), name
    out = target.head(target.up(torch.randn(4, 32)))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_linear_under_torch_compile_matches_eager(scaling):
    """Under ``torch.compile`` the activation is quantized by the torch expression (which inductor fuses into the
    producer) instead of the Triton kernels: the outputs must agree with eager, which uses those kernels on CUDA."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    linear = FP8Linear.from_linear(nn.Linear(256, 128, bias=True).to(device), activation_scaling=scaling)
    norm = nn.LayerNorm(256, elementwise_affine=False).to(device)

    def block(x: torch.Tensor) -> torch.Tensor:
        return linear(norm(x) * 1.5 + 0.25)  # an elementwise producer for inductor to fuse the quantization into

    x = torch.randn(4, 64, 256, device=device, dtype=dtype)
    eager = block(x)
    compiled = torch.compile(block, backend="inductor" if device == "cuda" else "eager", fullgraph=True)(x)
    assert compiled.shape == eager.shape and compiled.dtype == eager.dtype
    # The Triton kernels multiply by the scale's reciprocal where the torch expression divides: at most a few
    # values land one FP8 step apart, so compare within one FP8 step of the output's scale.
    tolerance = 0.07 * eager.float().abs().max().item()
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=0, atol=tolerance)


def test_linears_reading_one_input_quantize_it_once() -> None:
    """``quantized_input`` reuses the last result only for the same tensor object at the same version and scaling."""
    from fp8_cache import quantized_input

    x = torch.randn(8, 32)
    first = quantized_input(x, "row")
    assert quantized_input(x, "row") is first  # Q, K and V projections of one input
    assert quantized_input(x, "tensor") is not first  # another scaling
    other = x.clone()
    assert quantized_input(other, "row") is not first  # equal values, another tensor
    again = quantized_input(x, "row")
    x.mul_(2)  # modified in place: its version counter moved
    changed = quantized_input(x, "row")
    assert changed is not again and torch.equal(changed.scale, 2 * again.scale)
    with torch.inference_mode():  # no version counter: never reused
        y = torch.randn(4, 16)
        assert quantized_input(y, "row") is not quantized_input(y, "row")
