"""The model's declarations, applied through the real dlo_offload and fp8_cache libraries on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

import omni_models
from omni_models.integrations import offload_plan, quantize_fp8


@pytest.fixture
def pipe(random_model_dir):
    return omni_models.load(str(random_model_dir))


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


def test_layerwise_offload_of_the_blocks_gives_the_same_image(pipe):
    from dlo_offload import enable_layerwise_offload

    request = dict(prompt="a red circle at the top", num_inference_steps=3, seed=4)
    expected = _pixels(pipe(**request))
    handle = enable_layerwise_offload(pipe.model, offload_plan(), device="cpu", pin_memory=False)
    try:
        offloaded = _pixels(pipe(**request))
    finally:
        handle.remove()
    assert np.array_equal(offloaded, expected)
    assert np.array_equal(_pixels(pipe(**request)), expected)


def test_fp8_quantizes_exactly_the_block_attention_and_mlp_linears(pipe):
    from fp8_cache import FP8Linear

    request = dict(prompt="a red circle at the top", num_inference_steps=3, seed=4)
    expected = _pixels(pipe(**request))
    report = quantize_fp8(pipe.model)
    assert sorted(report.quantized) == sorted(
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    )
    assert {"patch_embedding", "final_layer.linear", "blocks.0.modulation", "timestep_embedding.fc1"} <= set(
        report.skipped
    )
    assert isinstance(pipe.model.blocks[1].mlp.fc2, FP8Linear)
    quantized = _pixels(pipe(**request))
    difference = np.abs(quantized - expected)
    assert 0 < difference.mean() < 8  # FP8 error, not a different image
