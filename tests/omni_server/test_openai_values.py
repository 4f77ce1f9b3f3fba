"""The OpenAI images API as its clients send it: values that describe what the server does anyway are accepted,
values it cannot honour get a 400 naming the field, ``output_format`` re-encodes, and the official SDK's
``images.generate`` and ``models.retrieve`` work unchanged (a real server on loopback)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def server(server_factory):
    handle = server_factory("--max-num-seqs", "4")
    yield handle
    handle.stop()


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)


def _images(response: httpx.Response) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in response.json()["data"]]


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": False},
        {"quality": "auto"},
        {"background": "auto"},
        {"background": "opaque"},
        {"moderation": "auto"},
        {"moderation": "low"},
        {"n": None},
        {"response_format": None},
        {"response_format": "b64_json"},
        {"size": "auto"},
        {"size": None},
        {"user": "u-1"},
        {"safety_identifier": "s-1"},
        {"partial_images": 0},
        {"output_format": "png"},
    ],
    ids=lambda extra: "-".join(f"{k}={v}" for k, v in extra.items()),
)
def test_openai_values_that_describe_what_the_server_does_are_accepted(server, extra: dict) -> None:
    body = {"prompt": "a red circle", "num_inference_steps": 1, "seed": 2, **extra}
    response = _post(server, body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert len(payload["data"]) == 1 and (payload["output_format"], payload["size"]) == ("png", "32x32")
    assert _images(response)[0].size == (32, 32)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"quality": "high"}, "quality"),
        ({"background": "transparent"}, "background"),
        ({"response_format": "url"}, "response_format"),
        ({"output_format": "gif"}, "output_format"),
        ({"style": "vivid"}, "style"),
        ({"partial_images": 2}, "partial_images"),
        ({"output_compression": 101}, "output_compression"),
    ],
)
def test_openai_values_the_server_cannot_honour_get_400_naming_the_field(server, extra: dict, param: str) -> None:
    response = _post(server, {"prompt": "a red circle", "num_inference_steps": 1, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("output_format", "compression"), [("jpeg", 80), ("webp", None), ("png", None)])
def test_output_format_re_encodes_the_image(server, output_format: str, compression: int | None) -> None:
    body = {"prompt": "a red circle", "num_inference_steps": 1, "seed": 2, "output_format": output_format}
    if compression is not None:
        body["output_compression"] = compression
    response = _post(server, body)
    assert response.status_code == 200, response.text
    image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    assert (image.format, image.size) == ({"jpeg": "JPEG", "webp": "WEBP", "png": "PNG"}[output_format], (32, 32))


def test_the_openai_sdk_generates_and_retrieves(server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(
        model="omni-shapes-tiny",
        prompt="a red circle",
        n=2,
        stream=False,
        quality="auto",
        output_format="png",
        extra_body={"seed": 4, "num_inference_steps": 2},
    )
    assert len(result.data) == 2 and all(item.b64_json for item in result.data)
    assert result.data[0].b64_json != result.data[1].b64_json  # seeds 4 and 5
    model = client.models.retrieve("omni-shapes-tiny")
    assert (model.id, model.object) == ("omni-shapes-tiny", "model") and model.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# --- the step cache (issue 26): a request's cache field, its 400s, the presets, usage and /metrics --------------


@pytest.mark.parametrize(
    ("cache", "needle"),
    [
        ("slow", "presets off, safe, fast"),
        ({"treshold": 0.1}, "unknown knob(s) treshold"),
        ({"threshold": 11}, "cache.threshold"),
        ({"first_blocks": 6}, "leaves no middle block"),
        ([1], "cache"),
    ],
)
def test_a_bad_cache_gets_400_naming_the_field(server, cache, needle: str) -> None:
    response = _post(server, {"prompt": "a red circle", "cache": cache, "num_inference_steps": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache" and needle in error["message"]


def test_cache_presets_usage_and_metrics(server, tools) -> None:
    metric = tools.metric
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert set(model["step_cache_presets"]) == {"off", "safe", "fast"} and "cache" in model["accepts"]
    assert model["step_cache_presets"]["fast"]["threshold"] > model["step_cache_presets"]["safe"]["threshold"]
    before = metric(server.metrics(), "omni:step_cache_steps_total", decision="cached")
    custom = {"preset": "fast", "threshold": 5.0, "warmup_steps": 1}  # skips whenever the guards let it
    body = {"prompt": "a red circle", "n": 2, "seed": 4, "num_inference_steps": 6, "cache": custom}
    response = _post(server, body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]["step_cache"]
    assert [u["decisions"] for u in usage] == ["CSSSCC"] * 2  # warm-up, 3 cached in a row at most, the last step
    assert usage[0]["computed_steps"] == 3 and usage[0]["block_fraction"] == pytest.approx(1 - 3 * 5 / (6 * 6))
    assert usage[0]["residual_diffs"][0] is None and all(d >= 0 for d in usage[0]["residual_diffs"][1:])
    after = metric(server.metrics(), "omni:step_cache_steps_total", decision="cached")
    assert after - before == 6
    plain = _post(server, {"prompt": "a red circle", "seed": 4, "num_inference_steps": 6, "cache": "off"})
    assert "usage" not in plain.json()
