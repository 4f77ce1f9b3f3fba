"""The fused, indexed token ops of ``omni_models.fused``: the torch reference against the unfused sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp8_cache import FP8_MAX, FP8Activation, FP8Linear
from omni_models import fused

sys.path.insert(0, str(Path(__file__).parent))
from fused_cases import DEVICE, modulated_tokens  # noqa: E402

EPS = 1e-6


def test_reference_equals_the_unfused_torch_sequence_in_float32():
    x, (shift, scale, gate, shift2, scale2, _), row_ids = modulated_tokens()
    unfused = F.layer_norm(x, (x.shape[1],), eps=EPS) * (1 + scale[row_ids]) + shift[row_ids]
    got = fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, backend="torch")
    torch.testing.assert_close(got, unfused, rtol=1e-6, atol=1e-6)
    branch = torch.randn_like(x)
    residual = x + gate[row_ids] * branch
    torch.testing.assert_close(fused.gated_residual(x, gate, branch, row_ids, backend="torch"), residual)
    updated, modulated = fused.gated_residual_layer_norm_modulate(
        x, gate, branch, shift2, scale2, row_ids, eps=EPS, backend="torch"
    )
    torch.testing.assert_close(updated, residual)
    expected = F.layer_norm(residual, (x.shape[1],), eps=EPS) * (1 + scale2[row_ids]) + shift2[row_ids]
    torch.testing.assert_close(modulated, expected, rtol=1e-6, atol=1e-6)


def test_each_token_reads_its_own_row():
    """Changing one row's modulation changes exactly the tokens that point at it."""
    x, (shift, scale, *_), row_ids = modulated_tokens(tokens=12, rows=4)
    row_ids = torch.tensor([0, 1, 2, 3] * 3, device=DEVICE)
    before = fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, backend="torch")
    shift = shift.clone()
    shift[2] += 1.0
    after = fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, backend="torch")
    changed = (after != before).any(dim=1)
    assert torch.equal(changed, row_ids == 2)


def test_bad_inputs_raise_and_name_the_problem():
    x, (shift, scale, *_), row_ids = modulated_tokens()
    with pytest.raises(ValueError, match="row_ids must be an int32/int64"):
        fused.layer_norm_modulate(x, shift, scale, row_ids.float(), eps=EPS)
    with pytest.raises(ValueError, match="row_ids must lie in"):
        fused.layer_norm_modulate(x, shift, scale, torch.full_like(row_ids, 3), eps=EPS)
    with pytest.raises(ValueError, match="shift must be a floating"):
        fused.layer_norm_modulate(x, shift[:, :-1], scale, row_ids, eps=EPS)
    with pytest.raises(ValueError, match="scale has 2 rows"):
        fused.layer_norm_modulate(x, shift, scale[:2], row_ids, eps=EPS)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        fused.layer_norm_modulate(x.t().contiguous().t(), shift, scale, row_ids, eps=EPS)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused.gated_residual(x, shift, x, row_ids, backend="cuda")
    with pytest.raises(ValueError, match="weight must have shape"):
        fused.rms_norm(x.view(9, 3, 16), torch.ones(8), eps=EPS)


def test_quantized_output_follows_the_fp8_contract_per_token():
    x, (shift, scale, *_), row_ids = modulated_tokens(dtype=torch.bfloat16)
    act = fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, quantize=True, backend="torch")
    assert isinstance(act, FP8Activation) and act.per_row and act.dtype == torch.bfloat16
    y = fused.layer_norm_modulate(x.float(), shift.float(), scale.float(), row_ids, eps=EPS, backend="torch")
    torch.testing.assert_close(act.scale, y.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    assert (act.data.float().abs().amax(dim=1) == FP8_MAX).all()  # each token's largest value maps to 448
    err = (act.data.float() * act.scale - y).abs()
    assert bool((err <= y.abs() * 2.0**-4 + act.scale * 2.0**-9).all())


def test_fp8_linear_consumes_the_quantized_activation_like_its_dequantized_values():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 32).to(DEVICE)
    fp8 = FP8Linear.from_linear(linear)
    x, (shift, scale, *_), row_ids = modulated_tokens()
    act = fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, quantize=True, backend="torch")
    torch.testing.assert_close(fp8(act), fp8(act.dequantize()), rtol=1e-5, atol=1e-5)
