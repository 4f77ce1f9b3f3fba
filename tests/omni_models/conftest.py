"""Shared fixtures: a small random-weight model directory (mechanics tests need no trained weights)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter, which must be chosen before anything imports Triton:
# diffusers/transformers (the family tests) import it too, and tl.sum & co. would then be compiled-mode functions
# that interpreted kernels cannot call.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from omni_models.checkpoint import save_config, save_weights
from omni_models.config import DiTConfig
from omni_models.model import CausalPrefixDiT
from omni_models.training.captions import VOCABULARY


def build_random_model(seed: int = 0) -> CausalPrefixDiT:
    """A small model whose zero-initialised (adaLN, output) weights are randomised too, so every path matters."""
    config = DiTConfig(
        name="random-small",
        width=64,
        depth=2,
        num_heads=2,
        patch_size=4,
        vocab_size=len(VOCABULARY),
        max_prompt_tokens=16,
        default_steps=4,
    )
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


# --- the diffusers families: tiny random-weight checkpoints written here (no hub) -----------------------------------


def image_psnr(a, b) -> float:
    """PSNR in dB between two 8-bit images (PIL or arrays); inf when identical."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


@pytest.fixture(scope="session")
def psnr():
    return image_psnr


def _family_checkpoint(tmp_path_factory: pytest.TempPathFactory, family: str, **kwargs) -> Path:
    pytest.importorskip("diffusers")
    from omni_models import synthetic

    build = synthetic.flux_components if family == "flux" else synthetic.qwen_image_components
    directory = tmp_path_factory.mktemp(family)
    # Small shards, so the index and several files per component are exercised.
    return synthetic.save_checkpoint(family, build("tiny", **kwargs), directory, max_shard_size="40KB")


@pytest.fixture(scope="session")
def flux_dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _family_checkpoint(tmp_path_factory, "flux", guidance_embeds=True)


@pytest.fixture(scope="session")
def flux_schnell_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _family_checkpoint(tmp_path_factory, "flux", guidance_embeds=False)


@pytest.fixture(scope="session")
def qwen_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _family_checkpoint(tmp_path_factory, "qwen-image")


def _wan_checkpoint(tmp_path_factory: pytest.TempPathFactory, variant: str) -> Path:
    pytest.importorskip("diffusers")
    from omni_models import synthetic

    directory = tmp_path_factory.mktemp(variant)
    return synthetic.save_checkpoint("wan", synthetic.wan_components(variant), directory, max_shard_size="40KB")


@pytest.fixture(scope="session")
def wan21_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_checkpoint(tmp_path_factory, "wan2.1")


@pytest.fixture(scope="session")
def wan22_a14b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_checkpoint(tmp_path_factory, "wan2.2-a14b")


@pytest.fixture(scope="session")
def wan22_ti2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wan_checkpoint(tmp_path_factory, "wan2.2-ti2v")


# --- a local Hugging Face cache ----------------------------------------------------------------------------------


class HubCache:
    """A private Hugging Face cache directory that huggingface_hub uses for the test (offline)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, repo_id: str, source: Path, commit: str) -> None:
        """Lay ``source`` out as huggingface_hub's cache holds a downloaded snapshot: content-addressed blobs, a
        snapshot tree of relative symlinks into them, and ``refs/main`` naming the commit."""
        repo = self.root / ("models--" + repo_id.replace("/", "--"))
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / commit / file.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be fetched, even with allow_download=True
    return HubCache(root)
