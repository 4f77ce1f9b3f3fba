"""Model resolution (shipped name, directory, local Hugging Face cache), sharded weights, request validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import omni_models
from omni_models import CheckpointError, InvalidRequestError
from omni_models.checkpoint import INDEX_NAME, load_weights, save_weights


def test_sharded_weights_round_trip_and_respect_the_size_limit(tmp_path, random_model):
    state = random_model.state_dict()
    limit = 256 * 1024
    files = save_weights(state, tmp_path, max_shard_bytes=limit)
    assert len(files) > 1 and all(path.stat().st_size <= limit for path in files)
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(state)
    loaded = load_weights(tmp_path)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    with pytest.raises(ValueError, match="more than one shard may hold"):
        save_weights({"big": torch.zeros(1024, 1024)}, tmp_path / "too-big", max_shard_bytes=limit)


def test_load_from_the_local_hugging_face_cache(hub_cache, random_model_dir):
    commit = "0123456789abcdef0123456789abcdef01234567"
    hub_cache.add("omni/shapes-random", random_model_dir, commit)
    pipe = omni_models.load("omni/shapes-random")
    assert (pipe.info.name, pipe.info.variant) == ("omni/shapes-random", "random-small")
    assert omni_models.load(f"omni/shapes-random@{commit}").info.variant == "random-small"
    with pytest.raises(InvalidRequestError, match="not a repo id present in the local Hugging Face cache") as info:
        omni_models.load("omni/not-downloaded")
    assert info.value.param == "model"


def test_unknown_models_and_non_model_directories(tmp_path):
    with pytest.raises(InvalidRequestError, match="unknown model 'stable-diffusion'") as info:
        omni_models.load("stable-diffusion")
    assert info.value.param == "model"
    with pytest.raises(CheckpointError, match="not a model directory: it has neither model_index.json"):
        omni_models.load(str(tmp_path))


def test_mismatched_weights_are_refused(tmp_path, random_model_dir):
    shutil.copytree(random_model_dir, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["depth"] = 3
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing \['blocks.2"):
        omni_models.load(str(tmp_path / "model"))


@pytest.fixture(scope="module")
def pipe(random_model_dir):
    return omni_models.load(str(random_model_dir))


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"prompt": "a red hexagon"}, "prompt", "'hexagon'"),
        ({"prompt": ""}, "prompt", "non-empty"),
        ({"prompt": ["a red circle", 7]}, "prompt", "non-empty string"),
        ({"prompt": []}, "prompt", "empty"),
        ({"negative_prompt": "a mauve square"}, "negative_prompt", "'mauve'"),
        ({"negative_prompt": ["a red circle", "a blue square"]}, "negative_prompt", "2 negative prompts for 1"),
        ({"height": 64, "width": 64}, "size", "64x64"),
        ({"width": 31}, "size", "size 31x32 is not supported by random-small; supported sizes: 32x32"),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 1000]"),
        ({"num_inference_steps": 2.5}, "num_inference_steps", "2.5"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "finite"),
        ({"guidance_scale": -1}, "guidance_scale", "[0, 100]"),
        ({"seed": -3}, "seed", "-3"),
        ({"seed": True}, "seed", "True"),
    ],
)
def test_bad_requests_name_the_field(pipe, kwargs, param, fragment):
    request = {"prompt": "a red circle", "num_inference_steps": 2, **kwargs}
    with pytest.raises(InvalidRequestError) as info:
        pipe(**request)
    assert info.value.param == param
    assert fragment in str(info.value)


def test_info_describes_the_model(pipe):
    info = pipe.info
    assert info.image.sizes == ((32, 32),)
    assert info.image.default_steps == 4 and info.image.max_prompt_tokens == 16
    assert "circle" in info.vocabulary and "<bos>" not in info.vocabulary
    specs = pipe.kv_cache_specs()
    assert list(specs) == ["blocks.0.attn", "blocks.1.attn"]
    assert {(s.cache_role, s.num_kv_heads, s.head_size, s.dtype) for s in specs.values()} == {
        ("primary", 2, 32, torch.float32)
    }
