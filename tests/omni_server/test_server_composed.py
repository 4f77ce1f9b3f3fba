"""The server composes every library: FP8 weights from the fp8_cache artifact + layerwise offload + paged KV.

What comes out of HTTP must be exactly what the same pipeline, loaded the same way in this process, draws
for the same request: the engine adds scheduling, not numerics.
"""

from __future__ import annotations

import base64
import io
import os

import httpx
from PIL import Image

from omni_server.config import build_config
from omni_server.engine import load_pipeline

MODEL = os.environ.get("OMNI_SERVER_TEST_MODEL", "omni-shapes-tiny")
REQUEST = {
    "prompt": "a green triangle at the top left on a white background",
    "num_inference_steps": 3,
    "seed": 11,
    "guidance_scale": 4.0,
    "n": 2,
}


def test_fp8_offload_server_draws_what_the_pipeline_draws(server_factory, tmp_path) -> None:
    cache = tmp_path / "fp8"
    flags = {
        "quantization": "fp8",
        "fp8_cache_dir": str(cache),
        "enable_layerwise_offload": True,
        "offload_resident_blocks": 1,
    }
    server = server_factory(
        "--quantization",
        "fp8",
        "--fp8-cache-dir",
        str(cache),
        "--enable-layerwise-offload",
        "--offload-resident-blocks",
        "1",
        "--kv-cache-memory-bytes",
        "16M",
    )
    response = httpx.post(f"{server.url}/v1/images/generations", json=REQUEST, timeout=120)
    assert response.status_code == 200, response.text
    served = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in response.json()["data"]]
    assert (cache / "COMPLETE").is_file()  # the server's start published the FP8 artifact
    server.stop()

    # Same flags in this process: the FP8 weights now come from the cache the server wrote (a hit).
    pipeline = load_pipeline(build_config(None, model=MODEL, device="cpu", **flags))
    direct = pipeline([REQUEST["prompt"]] * 2, num_inference_steps=3, seed=11, guidance_scale=4.0)
    assert len(served) == len(direct) == 2
    for from_server, from_pipeline in zip(served, direct, strict=True):
        assert (from_server.mode, from_server.size) == (from_pipeline.mode, from_pipeline.size)
        assert from_server.tobytes() == from_pipeline.tobytes()
