"""Attention opt-in and spec discovery over real nn.Module trees."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_kv import AttentionCacheSpec, KVCacheOptIn, discover_kv_cache_specs


class Attention(nn.Module):
    def __init__(self, dim: int, role: str | None, num_kv_heads: int = 2, head_size: int = 8):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3)
        self.diffusion_kv_cache = (
            KVCacheOptIn(cache_role=role, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16)
            if role is not None
            else None
        )


class Block(nn.Module):
    def __init__(self, role: str | None):
        super().__init__()
        self.attn = Attention(16, role)
        self.mlp = nn.Linear(16, 16)


class TinyDiT(nn.Module):
    def __init__(self, roles):
        super().__init__()
        self.blocks = nn.ModuleList(Block(r) for r in roles)


def test_discovery_is_ordered_and_skips_dense_layers():
    model = TinyDiT(["primary", None, "primary", "ar_decode"])
    specs = discover_kv_cache_specs(model)
    assert list(specs) == ["blocks.0.attn", "blocks.2.attn", "blocks.3.attn"]
    assert specs["blocks.3.attn"] == AttentionCacheSpec("blocks.3.attn", "ar_decode", 2, 8, torch.bfloat16)
    assert specs["blocks.0.attn"].page_size_bytes(16) == 16 * 2 * 2 * 8 * 2


def test_opt_in_adds_no_state():
    dense = TinyDiT([None, None])
    paged = TinyDiT(["primary", "primary"])
    assert dense.state_dict().keys() == paged.state_dict().keys()


def test_no_cache_enabled_layer_names_the_model_class():
    with pytest.raises(RuntimeError, match="found no cache-enabled Attention modules in TinyDiT"):
        discover_kv_cache_specs(TinyDiT([None, None]))


def test_wrong_opt_in_type_names_the_layer():
    model = TinyDiT(["primary"])
    model.blocks[0].attn.diffusion_kv_cache = {"cache_role": "primary"}
    with pytest.raises(TypeError, match="'blocks.0.attn' sets diffusion_kv_cache to dict"):
        discover_kv_cache_specs(model)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cache_role": ""}, "cache_role must be a non-empty str"),
        ({"num_kv_heads": 0}, "num_kv_heads must be a positive int"),
        ({"head_size": 64.0}, "head_size must be a positive int"),
        ({"dtype": torch.int8}, "dtype must be one of"),
    ],
)
def test_opt_in_rejects_bad_fields(kwargs, match):
    fields = {"cache_role": "primary", "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCacheOptIn(**fields)
