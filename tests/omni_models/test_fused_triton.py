"""The fused token kernels (Triton) against the torch reference of ``omni_models.fused``.

Without CUDA the kernels run on CPU tensors under the Triton interpreter; the variable must be set before
``omni_models._fused_triton`` is imported, hence at this module's import (nothing imports it on CPU otherwise).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from omni_models import fused  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fused_cases import DEVICE, modulated_tokens  # noqa: E402

EPS = 1e-6
pytestmark = pytest.mark.triton


def _kernels_module():
    from omni_models import _fused_triton

    assert ON_CUDA or _fused_triton.INTERPRETED, (
        "omni_models._fused_triton was imported before TRITON_INTERPRET=1 was set; export TRITON_INTERPRET=1"
    )
    return _fused_triton


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernels_match_the_reference(dtype, tol):
    _kernels_module()
    x, (shift, scale, gate, shift2, scale2, _), row_ids = modulated_tokens(dtype=dtype, seed=1)
    branch = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = {
        b: fused.layer_norm_modulate(x, shift, scale, row_ids.int(), eps=EPS, backend=b) for b in ("triton", "torch")
    }
    torch.testing.assert_close(out["triton"].float(), out["torch"].float(), rtol=tol, atol=tol)
    res = {b: fused.gated_residual(x, gate, branch, row_ids, backend=b) for b in ("triton", "torch")}
    torch.testing.assert_close(res["triton"].float(), res["torch"].float(), rtol=tol, atol=tol)
    both = {
        b: fused.gated_residual_layer_norm_modulate(x, gate, branch, shift2, scale2, row_ids, eps=EPS, backend=b)
        for b in ("triton", "torch")
    }
    for got, ref in zip(both["triton"], both["torch"], strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    heads = x.view(9, 3, 16)
    weight = torch.rand(16, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    torch.testing.assert_close(
        fused.rms_norm(heads, weight, eps=EPS, backend="triton").float(),
        fused.rms_norm(heads, weight, eps=EPS, backend="torch").float(),
        rtol=tol,
        atol=tol,
    )


def test_quantizing_kernels_match_the_reference_within_one_fp8_step():
    """Scales agree to float32 rounding, values to one FP8 step.

    The interpreter's float->fp8 cast drops the carry when rounding reaches the next power of two (124.99 -> 64,
    not 128), which the hardware does not: under the interpreter, elements whose reference rounds to a power of
    two are left out of the value comparison (the scales still cover them). Its float32->bfloat16 cast truncates
    instead of rounding, so the interpreted run keeps the residual stream in float32.
    """
    kernels = _kernels_module()
    dtype = torch.float32 if kernels.INTERPRETED else torch.bfloat16
    x, (shift, scale, gate, shift2, scale2, _), row_ids = modulated_tokens(dtype=dtype, seed=4)
    branch = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    pairs = [
        [
            fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, quantize=True, backend=b)
            for b in ("triton", "torch")
        ],
        [
            fused.gated_residual_layer_norm_modulate(
                x, gate, branch, shift2, scale2, row_ids, eps=EPS, quantize=True, backend=b
            )[1]
            for b in ("triton", "torch")
        ],
        [fused.gelu_quantize(branch, backend=b) for b in ("triton", "torch")],
    ]
    for got, ref in pairs:
        assert got.data.dtype == ref.data.dtype and got.scale.shape == ref.scale.shape == (x.shape[0], 1)
        torch.testing.assert_close(got.scale, ref.scale, rtol=1e-5, atol=0)
        ref_q = ref.data.float().abs()
        compare = torch.ones_like(ref_q, dtype=torch.bool)
        if kernels.INTERPRETED:
            compare = (ref_q == 0) | (torch.log2(ref_q) != torch.log2(ref_q).round())
        step = ref_q * 2.0**-3 + 2.0**-9
        assert bool(((got.data.float() - ref.data.float()).abs() <= step)[compare].all())
        assert compare.float().mean() > 0.8


def test_kernels_handle_empty_batches_and_strided_modulation_rows():
    _kernels_module()
    x, (shift, scale, *_), row_ids = modulated_tokens(tokens=0)
    assert fused.layer_norm_modulate(x, shift, scale, row_ids, eps=EPS, backend="triton").shape == (0, 48)
    assert shift.stride(0) == 6 * 48  # column slices of the [R, 6W] projection, read in place


def test_gelu_quantize_walks_wide_tokens_in_chunks():
    """A token wider than one chunk: the amax covers every chunk, and the last partial chunk is masked."""
    kernels = _kernels_module()
    width = 2 * kernels.GELU_CHUNK + 5
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x[1, -1] = 9.0  # token 1's amax sits in its last, partial chunk
    got, ref = (fused.gelu_quantize(x, backend=b) for b in ("triton", "torch"))
    torch.testing.assert_close(got.scale, ref.scale, rtol=1e-5, atol=0)
    assert abs(got.scale[1].item() - 9.0 / 448.0) < 1e-6
    ref_q = ref.data.float().abs()
    compare = torch.ones_like(ref_q, dtype=torch.bool)
    if kernels.INTERPRETED:
        compare = (ref_q == 0) | (torch.log2(ref_q) != torch.log2(ref_q).round())
    assert bool(((got.data.float() - ref.data.float()).abs() <= ref_q * 2.0**-3 + 2.0**-9)[compare].all())
