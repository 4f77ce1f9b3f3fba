"""The shipped omni-shapes-tiny: loads from the package, follows prompts, paged == dense, seeds reproduce."""

from __future__ import annotations

import json

import numpy as np
import pytest

import omni_models
from omni_models.hub import WEIGHTS_ROOT
from omni_models.training.scorer import adherence, read_scenes
from omni_models.training.shapes import split_scenes

NUM_PROMPTS = 12
# The GPU evaluation over 200 held-out prompts is the headline figure (train_log.json); this CPU check uses the
# first held-out prompts with the package defaults (20 steps, guidance 4); the shipped weights score 100% there.
MIN_ATTRIBUTE_ACCURACY = 0.9


@pytest.fixture(scope="module")
def pipe():
    return omni_models.load("omni-shapes-tiny")


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


def test_shipped_files_and_recorded_training():
    directory = WEIGHTS_ROOT / "omni-shapes-tiny"
    assert all(path.stat().st_size <= 16 * 1024 * 1024 for path in directory.glob("*.safetensors"))
    log = json.loads((directory / "train_log.json").read_text())
    g1, g4 = log["eval"]["accuracy"]["guidance_1"], log["eval"]["accuracy"]["guidance_4"]
    assert log["eval"]["num_prompts"] == 200
    assert g4["attributes"] >= 0.9 and g4["attributes"] > g1["attributes"]
    assert g4["scene"] > g1["scene"]


def test_generated_images_follow_held_out_prompts(pipe):
    scenes = split_scenes()[1][:NUM_PROMPTS]
    images = pipe([scene.caption() for scene in scenes], guidance_scale=4.0, seed=100)
    score = adherence(read_scenes(images), scenes)
    assert score["attributes"] >= MIN_ATTRIBUTE_ACCURACY, score


def test_paged_and_dense_paths_give_the_same_image(pipe):
    dense = omni_models.load("omni-shapes-tiny", attention_backend="dense")
    prompts = ["a yellow triangle at the bottom right on a purple background", "a black square on a white background"]
    request = dict(seed=3, num_inference_steps=8)
    difference = np.abs(_pixels(pipe(prompts, **request)) - _pixels(dense(prompts, **request)))
    assert difference.max() <= 1


def test_fixed_seed_reproduces_the_image(pipe):
    first = _pixels(pipe("a green circle at the top", seed=42, num_inference_steps=10))
    assert np.array_equal(first, _pixels(pipe("a green circle at the top", seed=42, num_inference_steps=10)))
