"""Bad diffusers checkpoints fail with one ``CheckpointError`` line naming the file, before touching the device;
the repo-id path resolves through a local Hugging Face cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import omni_models
from omni_models import CheckpointError, InvalidRequestError

pytest.importorskip("diffusers")

# On this CPU-only build any placement on "cuda" raises at once, so a CheckpointError raised for device="cuda"
# shows that the checkpoint was rejected before anything was placed on the target device.
TARGET = "cpu" if torch.cuda.is_available() else "cuda"


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "checkpoint"))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _expect(path: Path, file: Path, fragment: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        omni_models.load(str(path), device=TARGET)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(file)), message
    assert fragment in message, message
    return info.value


def test_a_valid_checkpoint_gets_past_the_preflight_to_the_device(flux_dev_dir):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        omni_models.load(str(flux_dev_dir), device="cuda")


def test_a_directory_that_is_not_a_diffusers_checkpoint(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    _expect(tmp_path, tmp_path, "neither model_index.json")
    (tmp_path / "model_index.json").write_text("{not json")
    _expect(tmp_path, tmp_path / "model_index.json", "unreadable pipeline index")


def test_an_unknown_pipeline_class_or_component_class(flux_dev_dir, tmp_path):
    path = _copy(flux_dev_dir, tmp_path)
    _edit_json(path / "model_index.json", _class_name="StableDiffusion3Pipeline")
    _expect(
        path,
        path / "model_index.json",
        "unknown _class_name 'StableDiffusion3Pipeline'; supported: FluxKontextPipeline, FluxPipeline, "
        "QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline, WanPipeline",
    )
    _edit_json(path / "model_index.json", _class_name="FluxPipeline", vae=["diffusers", "AutoencoderTiny"])
    _expect(path, path / "model_index.json", "component 'vae' is ['diffusers', 'AutoencoderTiny']")


def test_a_missing_a_truncated_and_a_corrupt_shard(flux_dev_dir, tmp_path):
    path = _copy(flux_dev_dir, tmp_path)
    shards = _shards(path / "transformer")
    assert len(shards) > 2
    backup = shards[1].read_bytes()
    shards[1].unlink()
    _expect(path, shards[1], "missing shard (listed in diffusion_pytorch_model.safetensors.index.json)")
    shards[1].write_bytes(backup[:-40])
    _expect(path, shards[1], "corrupt or truncated safetensors file")
    shards[1].write_bytes(backup[:8] + b"#" * 16 + backup[24:])
    _expect(path, shards[1], "corrupt or truncated safetensors file")


def test_weights_that_disagree_with_their_config(flux_dev_dir, tmp_path):
    path = _copy(flux_dev_dir, tmp_path)
    config = path / "transformer" / "config.json"
    original = config.read_text()
    _edit_json(config, num_single_layers=3)
    _expect(path, path / "transformer", "weights lack tensor 'single_transformer_blocks.2.")
    config.write_text(original)
    _edit_json(config, pooled_projection_dim=48)
    error = _expect(path, path / "transformer", "has shape [32, 32] but transformer/config.json implies [32, 48]")
    assert error.path.name.startswith("diffusion_pytorch_model-")  # the shard holding the tensor
    config.write_text(original)
    t5_config = path / "text_encoder_2" / "config.json"
    original = t5_config.read_text()
    _edit_json(t5_config, d_ff=40)
    _expect(path, path / "text_encoder_2", "but text_encoder_2/config.json implies")
    t5_config.write_text(original)
    _edit_json(t5_config, num_layers=1)  # the weights hold a second block the config does not describe
    _expect(
        path,
        path / "text_encoder_2",
        "holds weights a model built from text_encoder_2/config.json does not have: ['encoder.block.1.",
    )


def test_a_tensor_stored_with_the_wrong_dtype(flux_dev_dir, tmp_path):
    path = _copy(flux_dev_dir, tmp_path)
    shard = _shards(path / "vae")[0]
    state = load_file(str(shard))
    name = next(iter(state))
    state[name] = state[name].to(torch.int32)
    save_file(state, str(shard))
    _expect(path, shard, f"tensor {name!r} is stored as I32; expected a floating dtype")


def test_components_that_do_not_fit_each_other_or_are_unsupported(flux_dev_dir, qwen_image_dir, tmp_path):
    from omni_models import synthetic

    path = _copy(flux_dev_dir, tmp_path)
    vae = synthetic.random_parameters(
        lambda: synthetic.library_class("diffusers", "AutoencoderKL")(
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=8,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        device="cpu",
        dtype=torch.float32,
    )
    shutil.rmtree(path / "vae")
    vae.save_pretrained(str(path / "vae"))
    _expect(path, path / "transformer" / "config.json", "in_channels=16 needs a VAE with 4 latent channels")
    qwen = Path(shutil.copytree(qwen_image_dir, tmp_path / "qwen"))
    _edit_json(qwen / "transformer" / "config.json", zero_cond_t=True)
    _expect(qwen, qwen / "transformer" / "config.json", "zero_cond_t=true (a Qwen-Image edit/distilled variant)")


def test_missing_configs_tokenizers_and_pickle_weights(flux_dev_dir, tmp_path):
    path = _copy(flux_dev_dir, tmp_path)
    (path / "text_encoder" / "config.json").unlink()
    _expect(path, path / "text_encoder" / "config.json", "missing text_encoder config")
    shutil.copy(flux_dev_dir / "text_encoder" / "config.json", path / "text_encoder" / "config.json")
    for file in (path / "tokenizer_2").iterdir():
        file.unlink()
    _expect(path, path / "tokenizer_2", "cannot load the tokenizer_2")
    shutil.rmtree(path / "tokenizer_2")
    shutil.copytree(flux_dev_dir / "tokenizer_2", path / "tokenizer_2")
    for file in (path / "vae").glob("*.safetensors*"):
        file.unlink()
    (path / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    _expect(path, path / "vae", "only safetensors weights are supported")


# --- repo ids through the local Hugging Face cache -------------------------------------------------------------------


def test_a_repo_id_resolves_through_the_local_hugging_face_cache(flux_dev_dir, hub_cache, psnr):
    from huggingface_hub import scan_cache_dir

    commit = "0123456789abcdef0123456789abcdef01234567"
    hub_cache.add("black-forest-labs/tiny-flux", flux_dev_dir, commit)
    info = scan_cache_dir(hub_cache.root)  # huggingface_hub's own reader accepts the layout
    assert not info.warnings and [r.repo_id for r in info.repos] == ["black-forest-labs/tiny-flux"]
    assert [rev.commit_hash for rev in next(iter(info.repos)).revisions] == [commit]
    pipe = omni_models.load("black-forest-labs/tiny-flux", max_sequence_length=16)
    assert isinstance(pipe, omni_models.FamilyPipeline) and pipe.info.name == "black-forest-labs/tiny-flux"
    local = omni_models.load(str(flux_dev_dir), max_sequence_length=16)
    request = dict(num_inference_steps=2, seed=1, height=16, width=16)
    assert psnr(pipe("a cat", **request)[0], local("a cat", **request)[0]) == float("inf")
    assert omni_models.load(f"black-forest-labs/tiny-flux@{commit}").info.family == "flux"
    for name, kwargs in (
        ("black-forest-labs/not-downloaded", {}),
        ("black-forest-labs/not-downloaded", {"allow_download": True}),
    ):
        with pytest.raises(InvalidRequestError, match="not a repo id present in the local Hugging Face cache") as e:
            omni_models.load(name, **kwargs)
        assert e.value.param == "model"
