"""The CUDA activation quantizer's Triton kernels, run on CPU through ``TRITON_INTERPRET=1``.

The interpreter's float->fp8 conversion does not round like the hardware, so inputs are chosen to be exactly
representable after scaling: any correct kernel must then reproduce the torch reference byte for byte. This
covers the cross-block amax reduction, the on-device scale, masking of the tail and the empty input.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from fp8_cache._triton_quant import quantize_activation_triton
    from fp8_cache.quant import FP8_DTYPE, MIN_SCALE, per_tensor_scale, quantize_with_scale

    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)]
    for shape in [(3, 4097), (1, 8192 * 2 + 5), (7,)]:
        picks = grid[torch.randint(len(grid), shape, generator=g)]
        picks.view(-1)[-1] = 448.0  # amax lands in the last (partial) block
        x = (picks * 2.0**-3).to(torch.bfloat16)  # scale = 448 * 2^-3 / 448 = 2^-3 exactly
        q, scale = quantize_activation_triton(x)
        assert scale.dtype == torch.float32 and scale.dim() == 0 and scale.item() == 2.0**-3, scale
        assert torch.equal(scale, per_tensor_scale(x))
        ref = quantize_with_scale(x, scale)
        assert q.shape == x.shape and q.dtype == FP8_DTYPE
        assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8)), shape
    q, scale = quantize_activation_triton(torch.zeros(4, 32, dtype=torch.bfloat16))
    min_scale = torch.tensor(MIN_SCALE, dtype=torch.float32)
    assert torch.equal(scale, min_scale) and torch.count_nonzero(q.float()) == 0
    q, scale = quantize_activation_triton(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert q.shape == (0, 32) and torch.equal(scale, min_scale)
    print("ok")
    """
)


@pytest.mark.triton
def test_activation_quantizer_kernels_match_the_torch_reference_on_exact_inputs():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


ROW_SCRIPT = textwrap.dedent(
    """
    import torch
    from fp8_cache._triton_quant import quantize_rows_triton
    from fp8_cache.quant import FP8_DTYPE, MIN_SCALE, per_row_scales, quantize_with_scale

    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)]
    for rows, width in [(5, 4097), (3, 48), (2, 9000)]:
        picks = grid[torch.randint(len(grid), (rows, width), generator=g)]
        picks[:, -1] = 448.0  # each row's amax lands in its last (partial) chunk
        exponents = torch.arange(rows, dtype=torch.float32)[:, None] - 3.0
        x = (picks * 2.0 ** exponents).to(torch.bfloat16)  # row r: scale 2^(r-3) exactly
        wide = torch.zeros(rows, width + 16, dtype=torch.bfloat16)
        wide[:, :width] = x
        q, scale = quantize_rows_triton(wide[:, :width])  # a strided view: the row stride is honoured
        assert scale.shape == (rows, 1) and torch.equal(scale, per_row_scales(x)), scale
        assert torch.equal(q.view(torch.uint8), quantize_with_scale(x, scale).view(torch.uint8)), (rows, width)
    q, scale = quantize_rows_triton(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert torch.equal(scale, torch.full((2, 1), MIN_SCALE)) and torch.count_nonzero(q.float()) == 0
    q, scale = quantize_rows_triton(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert q.shape == (0, 32) and scale.shape == (0, 1)
    print("ok")
    """
)


@pytest.mark.triton
def test_row_quantizer_kernel_matches_the_torch_reference_on_exact_inputs():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ROW_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
