"""Relative L2 of omni's FP8 attention against the default path on unit-normal Q/K/V (run as written below)."""

import os

import torch

from omni_models.attention import attention, fp8_attention

# Under TRITON_INTERPRET=1 the Triton kernel runs (interpreted): the small shape only.
shapes = [(3, 200, 4, 64)] if os.environ.get("TRITON_INTERPRET") == "1" else [(3, 200, 4, 64), (1, 4608, 24, 128)]
for shape in shapes:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=generator) for _ in range(3))
    exact = attention(q, k, v)
    print(shape, f"{float((fp8_attention(q, k, v) - exact).norm() / exact.norm()):.4f}")
