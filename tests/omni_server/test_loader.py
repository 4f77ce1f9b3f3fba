"""Loading as the server does (flags -> omni_models.load): models are built on the meta device, cached FP8 tensors are
installed directly (a warm start reads the cache's bytes, never the checkpoint's tensor data), and the layerwise-offload
handle stays on the pipeline. For the shipped DiT and for a real family."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from omni_server.config import build_config
from omni_server.engine import load_pipeline

SHIPPED = Path(__import__("omni_models").__file__).parent / "weights" / "omni-shapes-tiny"


def _zero_tensor_data(directory: Path) -> int:
    """Zero every safetensors file's tensor data under ``directory``, keeping its header (metadata readers still
    work), size and mtime (the FP8 cache's fingerprint of its sources). Returns how many files were zeroed."""
    shards = sorted(directory.rglob("*.safetensors"))
    for shard in shards:
        stat = shard.stat()
        data = shard.read_bytes()
        header_end = 8 + int.from_bytes(data[:8], "little")
        shard.write_bytes(data[:header_end] + bytes(len(data) - header_end))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return len(shards)


def _images(pipeline) -> list[bytes]:
    from omni_models import FamilyPipeline

    if isinstance(pipeline, FamilyPipeline):
        images = pipeline("a red circle", num_inference_steps=2, seed=3, height=16, width=16)
    else:
        images = pipeline("a red circle", num_inference_steps=2, seed=3)
    return [image.tobytes() for image in images]


def _weights(pipeline) -> torch.nn.Module:
    return getattr(pipeline, "model", None) or pipeline.transformer


@pytest.fixture(params=["omni-dit", "flux"])
def checkpoint(request, tmp_path) -> tuple[str, Path]:
    if request.param == "flux":
        pytest.importorskip("diffusers")
        source = request.getfixturevalue("family_dirs")["flux"]
    else:
        source = SHIPPED
    return request.param, Path(shutil.copytree(source, tmp_path / "checkpoint"))


def test_a_warm_fp8_start_reads_only_the_cache(checkpoint, tmp_path) -> None:
    kind, directory = checkpoint
    cache = tmp_path / "fp8-cache"
    config = build_config(None, model=str(directory), device="cpu", quantization="fp8", fp8_cache_dir=str(cache))
    online = _images(load_pipeline(build_config(None, model=str(directory), device="cpu", quantization="fp8")))
    cold = load_pipeline(config)  # a miss: quantizes the shards once and publishes the cache
    assert (cache / "COMPLETE").is_file() and _images(cold) == online
    weights = directory / "transformer" if kind == "flux" else directory
    assert _zero_tensor_data(weights) >= 1
    warm = load_pipeline(config)  # had it read the zeroed shards, its weights (and images) would be zeros
    assert _images(warm) == online
    assert all(t.device.type == "cpu" for t in _weights(warm).state_dict().values())
    zeroed = load_pipeline(build_config(None, model=str(directory), device="cpu"))  # the bf16 path reads them
    assert all(not t.any() for name, t in _weights(zeroed).state_dict().items() if name.endswith(".weight"))


def test_the_offload_handle_is_kept_and_the_image_is_the_resident_one(checkpoint) -> None:
    from dlo_offload import LayerwiseOffload

    _, directory = checkpoint
    resident = load_pipeline(build_config(None, model=str(directory), device="cpu"))
    offloaded = load_pipeline(build_config(None, model=str(directory), device="cpu", enable_layerwise_offload=True))
    assert resident.offload is None and isinstance(offloaded.offload, LayerwiseOffload)
    assert offloaded.device == torch.device("cpu")
    assert _images(offloaded) == _images(resident)
