"""A small DiT-like stack for the dlo_offload tests (imported by conftest and the 2-rank worker).

Each block mixes dtypes and layouts on purpose: float32 linears, an FP8
(float8_e4m3fn) weight stored transposed (stride (1, h)) with a float32 scale,
a persistent float buffer, a persistent bool buffer, and a non-persistent int64
buffer, so packing must preserve bytes, dtypes and strides to reproduce outputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FP8Projection(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        weight = torch.randn(hidden, hidden) / math.sqrt(hidden)
        scale = weight.abs().max() / 448.0
        quantized = (weight / scale).to(torch.float8_e4m3fn)
        self.weight = nn.Parameter(quantized.t().contiguous().t(), requires_grad=False)
        self.register_buffer("weight_scale", scale.reshape(1).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.float() * self.weight_scale).t()


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = FP8Projection(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.register_buffer("gate", torch.rand(hidden))
        self.register_buffer("keep", torch.rand(hidden) > 0.3)
        self.register_buffer("positions", torch.arange(hidden), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
        x = x + self.proj(attn) * self.gate
        return x + self.mlp(x) * self.keep + self.positions.float() * 1e-3


class TinyDiT(nn.Module):
    def __init__(self, hidden: int = 32, num_blocks: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(num_blocks))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SingleStreamBlock(nn.Module):
    """A block of another shape (wider MLP, no FP8), so two block lists need differently sized slots."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp_in = nn.Linear(hidden, 4 * hidden)
        self.mlp_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm(x))))


class TwoListDiT(nn.Module):
    """FLUX-shaped: ``double_blocks`` then ``single_blocks``, two block lists run one after the other."""

    def __init__(self, hidden: int = 32, num_double: int = 3, num_single: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(hidden, hidden)
        self.double_blocks = nn.ModuleList(Block(hidden) for _ in range(num_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(hidden) for _ in range(num_single))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.double_blocks:
            x = block(x)
        for block in self.single_blocks:
            x = block(x)
        return self.head(x)


def make_two_list_model(*, hidden: int = 32, num_double: int = 3, num_single: int = 4, seed: int = 0) -> TwoListDiT:
    torch.manual_seed(seed)
    return TwoListDiT(hidden, num_double, num_single).requires_grad_(False)


def make_model(*, hidden: int = 32, num_blocks: int = 5, seed: int = 0) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT(hidden, num_blocks).requires_grad_(False)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes a tensor's elements hold, in logical order (dtype-agnostic, NaN-safe)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def assert_state_identical(got: nn.Module, want: nn.Module) -> None:
    """Every parameter and buffer equal in bytes, dtype, shape and stride."""
    got_state = dict(got.named_parameters()) | dict(got.named_buffers())
    want_state = dict(want.named_parameters()) | dict(want.named_buffers())
    assert got_state.keys() == want_state.keys()
    for name, w in want_state.items():
        g = got_state[name]
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride()), name
        assert tensor_bytes(g) == tensor_bytes(w), name
