"""Inputs shared by the fused-op tests (torch reference and Triton kernels): tokens with per-row modulation."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def modulated_tokens(tokens=9, width=48, rows=3, dtype=torch.float32, seed=0):
    """``x [tokens, width]``, the six ``[rows, width]`` modulation chunks (shift, scale, gate, shift2, scale2,
    gate2) and ``row_ids [tokens]`` (each token's row), seeded on CPU so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g).to(DEVICE, dtype)
    modulation = (0.3 * torch.randn(rows, 6 * width, generator=g)).to(DEVICE, dtype)
    row_ids = torch.randint(rows, (tokens,), generator=g).to(DEVICE)
    return x, modulation.chunk(6, dim=-1), row_ids
