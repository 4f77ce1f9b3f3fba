"""``omni-server generate``: the one-shot CLI over the serving engine, its checks before loading, and the load path's
FP8 (fp8_cache) and offload (dlo_offload) options."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import msgspec
import pytest
import torch
from PIL import Image

import omni_models
from omni_server.config import build_config
from omni_server.generate import GenerateError, generate_to_files, output_paths, request_from_args

# OMNI_SERVER_TEST_MODEL runs the suite against another local model directory; default: the shipped model.
MODEL = os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny")
PROMPT = "a red circle on a blue background"


def _args(**fields) -> Namespace:
    """The request flags of ``generate`` as argparse gives them (unset: None; negative prompt: unset)."""
    defaults = dict(
        prompt=PROMPT,
        n=1,
        negative_prompt=msgspec.UNSET,
        num_inference_steps=None,
        guidance_scale=None,
        true_cfg_scale=None,
        size=None,
        image_seed=None,
        lyrics=None,
        max_new_tokens=None,
    )
    return Namespace(**{**defaults, **fields})


def _files(tmp_path: Path, name: str, config, **fields) -> list[Path]:
    spec = omni_models.inspect(config.model)
    request = request_from_args(_args(**fields), spec.info, config)
    return generate_to_files(config, spec, request, output=str(tmp_path / f"{name}.png"), progress_stream=io.StringIO())


def _generate(tmp_path: Path, name: str, **config) -> bytes:
    config = build_config(None, model=MODEL, device="cpu", **config)
    (path,) = _files(tmp_path, name, config, num_inference_steps=2, image_seed=5)
    return path.read_bytes()


def test_cli_writes_the_png_draws_a_progress_bar_and_upscales(tmp_path, capfd) -> None:
    """One plain run (PNG, progress bar, the small-image note) and one --upscale 8 run of the same seed: the upscaled
    image is the plain one with every pixel an 8x8 block."""
    out = tmp_path / "nested" / "out.png"
    base = [sys.executable, "-m", "omni_server", "generate", PROMPT, "--model", MODEL, "--device", "cpu"]
    base += ["--steps", "3", "--image-seed", "1"]
    result = subprocess.run([*base, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert "denoising" in result.stderr and "3/3" in result.stderr
    assert "draws 32x32 images; --upscale 8" in result.stderr
    image = Image.open(out)
    assert image.format == "PNG" and image.mode == "RGB"

    # The upscaled run through the same CLI entry point, in this process (one interpreter start fewer).
    from omni_server.cli import main

    assert main([*base[3:], "-o", str(tmp_path / "big.png"), "--upscale", "8"]) == 0
    assert "--upscale 8" not in capfd.readouterr().err
    big_image = Image.open(tmp_path / "big.png")
    assert big_image.size == (256, 256)
    assert big_image.resize((32, 32), Image.Resampling.NEAREST).tobytes() == image.tobytes()


def test_cli_rejects_a_bad_request_naming_the_field(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "generate",
            "a zebra",
            "-o",
            str(tmp_path / "x.png"),
            "--model",
            MODEL,
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "PROMPT:" in result.stderr and "zebra" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_n_images_get_numbered_files_with_distinct_seeds(tmp_path) -> None:
    config = build_config(None, model=MODEL, device="cpu")
    paths = _files(tmp_path, "img", config, n=2, num_inference_steps=1, image_seed=9, guidance_scale=1.0)
    assert paths == output_paths(tmp_path / "img.png", 2) == [tmp_path / "img-0.png", tmp_path / "img-1.png"]
    assert paths[0].read_bytes() != paths[1].read_bytes()


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("big", "--size must look like WIDTHxHEIGHT"),
        ("32x", "--size must look like WIDTHxHEIGHT"),
        ("0x0", "--size: size 0x0: width and height must be positive"),
        ("33x17", "--size: size 33x17 is not supported by omni-shapes-tiny; supported sizes: 32x32"),
    ],
)
def test_bad_sizes_are_refused_from_metadata_naming_width_then_height(size: str, message: str) -> None:
    config = build_config(None, model="omni-shapes-tiny", device="cpu")
    with pytest.raises(GenerateError) as refused:
        request_from_args(_args(size=size), omni_models.inspect(config.model).info, config)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps: num_inference_steps must be an integer in [1, 1000]"),
        (["--size", "33x17"], "size 33x17 is not supported"),
        (["--lyrics", "la"], "--lyrics: omni-shapes-tiny does not use lyrics"),
        (["--true-cfg-scale", "3"], "--true-cfg-scale: omni-shapes-tiny does not use true_cfg_scale"),
        (["--device", "cuda"], "--device cuda: no CUDA device is visible on this machine"),
    ],
)
def test_the_cli_checks_arguments_against_the_metadata_before_loading(tmp_path, argv: list[str], message: str) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "generate", PROMPT, "-o", str(tmp_path / "x.png"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "x.png").exists()
    assert time.monotonic() - started < 60  # no model was loaded (a load plus generation takes longer here)


def _fp8_state(config_overrides: dict) -> dict:
    from fp8_cache import FP8Linear
    from omni_server.engine import load_pipeline

    pipeline = load_pipeline(build_config(None, model=MODEL, device="cpu", quantization="fp8", **config_overrides))
    fp8 = [name for name, module in pipeline.model.named_modules() if isinstance(module, FP8Linear)]
    assert fp8, "no linear was swapped for FP8Linear"
    return {
        name: tensor.view(-1).view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor
        for name, tensor in pipeline.model.state_dict().items()
    }


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
    assert _generate(tmp_path, "offload", enable_layerwise_offload=True, offload_resident_blocks=2) == resident
