"""Shared fixtures: a small random-weight model directory (mechanics tests need no trained weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_models.captions import VOCABULARY
from omni_models.checkpoint import save_config, save_weights
from omni_models.config import DiTConfig
from omni_models.model import CausalPrefixDiT


def build_random_model(seed: int = 0) -> CausalPrefixDiT:
    """A small model whose zero-initialised (adaLN, output) weights are randomised too, so every path matters."""
    config = DiTConfig(name="random-small", width=64, depth=2, num_heads=2, patch_size=4,
                       vocab_size=len(VOCABULARY), max_prompt_tokens=16, default_steps=4)
    torch.manual_seed(seed)
    model = CausalPrefixDiT(config)
    with torch.no_grad():
        for block in model.blocks:
            block.modulation.weight.normal_(std=0.05)
            block.modulation.bias.normal_(std=0.05)
        model.final_layer.modulation.weight.normal_(std=0.05)
        model.final_layer.linear.weight.normal_(std=0.05)
    return model


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("random-small")
    model = build_random_model()
    save_weights(model.state_dict(), directory)
    save_config(model.config, VOCABULARY, directory)
    return directory


@pytest.fixture
def random_model() -> CausalPrefixDiT:
    return build_random_model()
