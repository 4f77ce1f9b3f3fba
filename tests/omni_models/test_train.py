"""The training script end to end at smoke size: outputs, logged figures, loadable and reproducible weights."""

from __future__ import annotations

import json

import torch

import omni_models
from omni_models.checkpoint import MAX_SHARD_BYTES, load_weights
from omni_models.training.train import main


def test_training_writes_a_loadable_reproducible_model(tmp_path):
    args = ["--config", "tiny", "--smoke", "--max-steps", "1", "--time-budget-s", "120", "--seed", "3"]
    log = main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])

    out = tmp_path / "a"
    for name in ("config.json", "vocab.json", "train_log.json", "samples/g4_00.png", "samples/g1_03.png"):
        assert (out / name).is_file(), name
    assert all(path.stat().st_size <= MAX_SHARD_BYTES for path in out.glob("*.safetensors"))
    written = json.loads((out / "train_log.json").read_text())
    assert written["steps"] == log["steps"] == 1 and written["seed"] == 3
    assert set(written["eval"]["accuracy"]) == {"guidance_1", "guidance_4"}
    assert set(written["eval"]["accuracy"]["guidance_4"]) == {
        "shape",
        "color",
        "position",
        "background",
        "attributes",
        "scene",
    }
    assert written["eval"]["num_prompts"] == 4 and written["torch"] == torch.__version__
    assert len(written["losses"]) == 1 and written["losses"][0][0] == 1

    first, second = load_weights(out), load_weights(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    pipe = omni_models.load(str(out))
    assert pipe.info.variant == "omni-shapes-tiny" and pipe.info.image.default_steps == 20
    assert pipe("a red circle", num_inference_steps=1, seed=0)[0].size == (32, 32)


def test_the_training_script_runs_by_its_module_path():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "omni_models.training.train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "--time-budget-s" in done.stdout, done.stderr
