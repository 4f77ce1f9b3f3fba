"""``omni-server generate``: the one-shot CLI, and the loader's FP8 (fp8_cache) and offload (dlo_offload) paths."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from omni_server.config import build_config
from omni_server.generate import GenerateError, generate_to_files, output_paths

# OMNI_SERVER_TEST_MODEL runs the suite against another local model directory; default: the shipped model.
MODEL = os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny")
PROMPT = "a red circle on a blue background"


def _generate(tmp_path: Path, name: str, **config) -> bytes:
    config = build_config(None, model=MODEL, device="cpu", **config)
    (path,) = generate_to_files(config, prompt=PROMPT, output=tmp_path / f"{name}.png", num_inference_steps=2,
                                seed=5, progress_stream=io.StringIO())
    return path.read_bytes()


def test_cli_writes_the_png_and_draws_a_progress_bar(tmp_path) -> None:
    out = tmp_path / "nested" / "out.png"
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "generate", PROMPT, "-o", str(out), "--model", MODEL, "--device", "cpu",
         "--steps", "3", "--image-seed", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert "denoising" in result.stderr and "3/3" in result.stderr
    image = Image.open(out)
    assert image.format == "PNG" and image.mode == "RGB"


def test_cli_rejects_a_bad_request_naming_the_field(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "generate", "a zebra", "-o", str(tmp_path / "x.png"), "--model", MODEL,
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "prompt:" in result.stderr and "zebra" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_n_images_get_numbered_files_with_distinct_seeds(tmp_path) -> None:
    config = build_config(None, model=MODEL, device="cpu")
    paths = generate_to_files(config, prompt=PROMPT, output=tmp_path / "img.png", n=2, num_inference_steps=1, seed=9,
                              guidance_scale=1.0, progress_stream=io.StringIO())
    assert paths == output_paths(tmp_path / "img.png", 2) == [tmp_path / "img-0.png", tmp_path / "img-1.png"]
    assert paths[0].read_bytes() != paths[1].read_bytes()


@pytest.mark.parametrize("size", ["big", "0x32", "32x"])
def test_bad_sizes_are_refused_before_loading(tmp_path, size: str) -> None:
    with pytest.raises(GenerateError, match="--size must look like WIDTHxHEIGHT"):
        generate_to_files(build_config(None, model=MODEL, device="cpu"), prompt=PROMPT, output=tmp_path / "a.png",
                          size=size)


def _fp8_state(config_overrides: dict) -> dict:
    from fp8_cache import FP8Linear

    from omni_server.loader import load_pipeline

    pipeline = load_pipeline(build_config(None, model=MODEL, device="cpu", quantization="fp8", **config_overrides))
    fp8 = [name for name, module in pipeline.model.named_modules() if isinstance(module, FP8Linear)]
    assert fp8, "no linear was swapped for FP8Linear"
    return {name: tensor.view(-1).view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor
            for name, tensor in pipeline.model.state_dict().items()}


def test_fp8_cache_miss_then_hit_loads_the_online_fp8_weights_bit_for_bit(tmp_path) -> None:
    cache = tmp_path / "fp8-cache"
    online = _fp8_state({})
    miss = _fp8_state({"fp8_cache_dir": str(cache)})
    assert (cache / "COMPLETE").is_file()  # the first start published the artifact
    hit = _fp8_state({"fp8_cache_dir": str(cache)})
    assert online.keys() == miss.keys() == hit.keys()
    for name, tensor in online.items():
        assert torch.equal(tensor, miss[name]) and torch.equal(tensor, hit[name]), name


def test_layerwise_offload_gives_the_resident_image(tmp_path) -> None:
    resident = _generate(tmp_path, "resident")
    assert _generate(tmp_path, "offload", enable_layerwise_offload=True, offload_resident_layers=2) == resident
