"""Shared fixtures: a small random bf16 component saved as real safetensors files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def make_component(directory: Path, *, seed: int = 0, files: int = 2) -> Path:
    """A tiny 'transformer' in ``files`` safetensors shards: linears (aligned and not), norms, an embedding."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "embed.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=g).bfloat16(),
        "blocks.0.attn.qkv.bias": torch.randn(96, generator=g).bfloat16(),
        "blocks.0.mlp.fc1.weight": torch.randn(128, 32, generator=g).bfloat16(),
        "blocks.0.mlp.fc2.weight": torch.randn(32, 128, generator=g).bfloat16(),
        "blocks.0.norm.weight": torch.ones(32).bfloat16(),
        "blocks.1.attn.qkv.weight": torch.randn(96, 32, generator=g).bfloat16(),
        "blocks.1.mlp.fc1.weight": torch.randn(128, 32, generator=g).bfloat16(),
        "blocks.1.mlp.fc2.weight": torch.randn(32, 128, generator=g).bfloat16(),
        "head.weight": torch.randn(20, 32, generator=g).bfloat16(),
        "pos_ids": torch.arange(16),
    }
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for i in range(files):
        part = {n: tensors[n] for n in names[i::files]}
        save_file(part, str(directory / f"model-{i:05d}-of-{files:05d}.safetensors"))
    return directory


@pytest.fixture
def component(tmp_path: Path) -> Path:
    return make_component(tmp_path / "source")


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of two state dicts (FP8 compared as bytes)."""
    if a.keys() != b.keys():
        return False
    for name in a:
        x, y = a[name].cpu(), b[name].cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True
