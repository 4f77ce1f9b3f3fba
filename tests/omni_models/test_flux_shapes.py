"""The shipped omni-flux-shapes-tiny (FLUX.1-dev architecture, diffusers layout) and its training script.

- diffusers alone (a fresh interpreter that imports no omni module) loads and renders the shipped checkpoint;
- omni's FamilyPipeline renders the same images from the same seeds (fp32 from the stored fp16, PSNR >= 40 dB);
- prompt adherence on the CPU over a fixed subset of held-out scenes, bounded from the measured figure;
- ``python -m omni_models.training.train_flux --smoke`` writes a checkpoint both pipelines load and run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import omni_models
from omni_models.hub import WEIGHTS_ROOT
from omni_models.training.scorer import adherence, read_scenes
from omni_models.training.shapes import split_scenes

diffusers = pytest.importorskip("diffusers")

from omni_models.training import flux_shapes  # noqa: E402 - needs diffusers

SHIPPED = WEIGHTS_ROOT / flux_shapes.NAME
PARITY_PROMPTS = ["a red circle at the top left on a blue background", "on a green background, a white diamond"]
PARITY_SEED = 7
PARITY_STEPS = 8
TARGET_DB = 40.0
# CPU check of adherence: the first held-out scenes at 8 steps, default guidance, seeds 10000 + i (the GPU
# evaluation's). Measured on this subset on the CPU (fp32, 2026-12-02, the second model): 0.96875, one shape of 8
# misread (the GPU evaluation of all 200 at 8 steps: 0.970). The bound allows two more attribute readings of the
# 32 to flip (CPU BLAS differences can move a borderline image): 0.90625, where the first model measured 0.8125.
ADHERENCE_SCENES = 8
ADHERENCE_STEPS = 8
ADHERENCE_MEASURED = 0.96875
MIN_ADHERENCE = ADHERENCE_MEASURED - 2 / (4 * ADHERENCE_SCENES)

# Runs in `python -I` from an empty directory: only the installed diffusers/transformers/torch are importable
# through the code it runs, and it asserts afterwards that no omni module was loaded.
DIFFUSERS_ALONE = r"""
import json, sys
import numpy as np, torch
from diffusers import FluxPipeline

directory, out, steps, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
pipe = FluxPipeline.from_pretrained(directory, dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)
images = pipe(prompts, height=64, width=64, num_inference_steps=steps,
              generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(len(prompts))]).images
np.save(out, np.stack([np.asarray(image) for image in images]))
omni = sorted(m for m in sys.modules if m.split(".")[0] in ("omni_models", "omni_server", "diffusion_kv",
                                                             "dlo_offload", "fp8_cache", "cfg_pairing"))
assert not omni, f"omni modules were imported: {omni}"
"""


def _diffusers_alone(directory: Path, workdir: Path, prompts: list[str], *, steps: int, seed: int) -> np.ndarray:
    out = workdir / "diffusers_images.npy"
    subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            DIFFUSERS_ALONE,
            str(directory),
            str(out),
            str(steps),
            str(seed),
            json.dumps(prompts),
        ],
        cwd=workdir,
        check=True,
        timeout=300,
    )
    return np.load(out)


@pytest.fixture(scope="module")
def pipe():
    return omni_models.load(str(SHIPPED))


def test_shipped_checkpoint_is_flux_dev_architecture_and_small():
    transformer = json.loads((SHIPPED / "transformer" / "config.json").read_text())
    assert transformer["_class_name"] == "FluxTransformer2DModel" and transformer["guidance_embeds"] is True
    assert transformer["num_layers"] >= 1 and transformer["num_single_layers"] >= 1  # both block kinds
    vae = json.loads((SHIPPED / "vae" / "config.json").read_text())
    assert vae["_class_name"] == "AutoencoderKL" and vae["latent_channels"] == 16
    index = json.loads((SHIPPED / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    scheduler = json.loads((SHIPPED / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] is True
    assert vae["block_out_channels"] and 2 ** (len(vae["block_out_channels"]) - 1) == flux_shapes.VAE_SCALE_FACTOR
    assert sum(path.stat().st_size for path in SHIPPED.rglob("*") if path.is_file()) <= 40 * 10**6  # the cap
    for path in SHIPPED.glob("*/*.safetensors"):  # stored in fp16; both pipelines load it in the dtype asked for
        with safe_open(str(path), "pt") as weights:
            assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"F16"}, path
    log = json.loads((SHIPPED / "train_log.json").read_text())
    assert log["held_out_adherence"]["scenes"] == 200
    assert set(log["phases"]) == {"vae", "teacher", "distill"} and all(p["steps"] > 0 for p in log["phases"].values())


def test_diffusers_alone_renders_it_and_omni_renders_the_same_images(pipe, psnr, tmp_path):
    expected = _diffusers_alone(SHIPPED, tmp_path, PARITY_PROMPTS, steps=PARITY_STEPS, seed=PARITY_SEED)
    assert expected.shape == (len(PARITY_PROMPTS), 64, 64, 3) and expected.std() > 0
    images = pipe(PARITY_PROMPTS, num_inference_steps=PARITY_STEPS, seed=PARITY_SEED, height=64, width=64)
    figures = [psnr(image, reference) for image, reference in zip(images, expected, strict=True)]
    print(f"omni vs diffusers PSNR: {figures} dB")
    assert min(figures) >= TARGET_DB


def test_held_out_adherence_on_cpu(pipe):
    scenes = split_scenes()[1][:ADHERENCE_SCENES]
    images = pipe(
        [scene.caption() for scene in scenes], num_inference_steps=ADHERENCE_STEPS, seed=10_000, height=64, width=64
    )
    scores = adherence(read_scenes(flux_shapes.scorer_images(images)), scenes)
    print(f"first {ADHERENCE_SCENES} held-out scenes, {ADHERENCE_STEPS} steps: {scores}")
    assert scores["attributes"] >= MIN_ADHERENCE


def test_phrasings_cover_every_clause_order_with_the_canonical_caption_first():
    scene = split_scenes()[0][0]
    table = flux_shapes.phrasings(scene)
    assert table[0][0] == scene.caption() and abs(sum(w for _, w in table) - 1) < 1e-9
    texts = {text for text, _ in table}
    assert len(texts) == len(table)
    object_clause = scene.caption(with_position=False, with_background=False)
    background = scene.caption(with_position=False).removeprefix(object_clause + " ")
    assert f"{background}, {object_clause}." in texts  # background first


def test_smoke_training_writes_a_checkpoint_both_pipelines_load(tmp_path, psnr):
    from omni_models.training import train_flux

    out = tmp_path / "run"
    record = train_flux.main(["--smoke", "--out", str(out)])
    assert all(record["phases"][name]["steps"] == 3 for name in ("vae", "teacher", "distill"))
    assert json.loads((out / "train_log.json").read_text())["model"] == flux_shapes.NAME
    assert (out / "train_stdout.txt").read_text().count("step") >= 3
    expected = _diffusers_alone(out, tmp_path, ["a blue square"], steps=2, seed=3)
    image = omni_models.load(str(out))("a blue square", num_inference_steps=2, seed=3, height=64, width=64)[0]
    assert image.size == (64, 64) and psnr(image, expected[0]) >= TARGET_DB
