"""omni-server on the real families (FLUX.1-dev, Qwen-Image): parity with diffusers through the product.

Tiny random-weight checkpoints are written by ``omni_models.synthetic`` (no hub); images come from a real
``omni-server generate`` subprocess and from a real ``omni-server serve`` process on loopback, and each is compared
with diffusers' own ``FluxPipeline`` / ``QwenImagePipeline`` at ``generator=torch.Generator("cpu").manual_seed(seed)``.
Target: PSNR >= 40 dB in fp32.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

import omni_models

diffusers = pytest.importorskip("diffusers")

TARGET_DB = 40.0


def _reference(family: str, directory: Path):
    cls = diffusers.FluxPipeline if family == "flux" else diffusers.QwenImagePipeline
    pipe = cls.from_pretrained(str(directory), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _expected(reference, seed: int, **kwargs) -> Image.Image:
    return reference(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images[0]


def _check(psnr, label: str, images, expected) -> None:
    figures = [psnr(a, b) for a, b in zip(images, expected, strict=True)]
    print(f"{label}: PSNR vs diffusers {[round(f, 1) for f in figures]} dB")
    assert min(figures) >= TARGET_DB, figures


# (CLI flags, diffusers call) per family. Qwen-Image without a negative prompt gets the server's default " " and
# its default true-CFG scale 4.0, which is diffusers' call with negative_prompt=" ".
CLI_CASES = {
    "flux": (
        [
            "a red circle at the top left",
            "--steps",
            "3",
            "--size",
            "48x32",
            "--guidance-scale",
            "2.5",
            "--image-seed",
            "11",
            "-n",
            "2",
        ],
        [
            (
                11 + i,
                dict(
                    prompt="a red circle at the top left",
                    num_inference_steps=3,
                    height=32,
                    width=48,
                    guidance_scale=2.5,
                ),
            )
            for i in range(2)
        ],
    ),
    "qwen-image": (
        ["a blue square", "--steps", "3", "--size", "32x32", "--image-seed", "3"],
        [
            (
                3,
                dict(
                    prompt="a blue square",
                    negative_prompt=" ",
                    true_cfg_scale=4.0,
                    num_inference_steps=3,
                    height=32,
                    width=32,
                ),
            )
        ],
    ),
}


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_generate_cli_draws_what_diffusers_draws(family, family_dirs, tools, tmp_path) -> None:
    flags, cases = CLI_CASES[family]
    out = tmp_path / "out.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "generate",
            *flags,
            "--model",
            str(family_dirs[family]),
            "--device",
            "cpu",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    paths = [Path(line) for line in result.stdout.split()]
    assert len(paths) == len(cases)
    reference = _reference(family, family_dirs[family])
    _check(
        tools.psnr,
        f"{family} generate CLI",
        [Image.open(p) for p in paths],
        [_expected(reference, seed, **kwargs) for seed, kwargs in cases],
    )


def _post_all(client: httpx.Client, bodies: list[dict], headers: list[dict]) -> list[httpx.Response]:
    """All bodies at once (threads), so the engine batches them."""
    responses: list[httpx.Response | None] = [None] * len(bodies)

    def send(i: int) -> None:
        responses[i] = client.post("/v1/images/generations", json=bodies[i], headers=headers[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return responses  # type: ignore[return-value]


def _images(response: httpx.Response) -> list[Image.Image]:
    assert response.status_code == 200, response.text
    return [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]]


# Concurrent requests with different sizes, steps and guidance (and n) through one server; (body, diffusers calls).
HTTP_CASES = {
    "flux": [
        (
            {
                "prompt": "a red circle at the top left",
                "size": "48x32",
                "num_inference_steps": 4,
                "guidance_scale": 2.5,
                "seed": 11,
                "n": 2,
            },
            [
                (
                    11 + i,
                    dict(
                        prompt="a red circle at the top left",
                        height=32,
                        width=48,
                        num_inference_steps=4,
                        guidance_scale=2.5,
                    ),
                )
                for i in range(2)
            ],
        ),
        (
            {
                "prompt": "a photo of a cat in the snow",
                "negative_prompt": "blurry",
                "size": "32x32",
                "num_inference_steps": 2,
                "guidance_scale": 3.5,
                "true_cfg_scale": 2.0,
                "seed": 5,
            },
            [
                (
                    5,
                    dict(
                        prompt="a photo of a cat in the snow",
                        negative_prompt="blurry",
                        height=32,
                        width=32,
                        num_inference_steps=2,
                        guidance_scale=3.5,
                        true_cfg_scale=2.0,
                    ),
                )
            ],
        ),
        (
            {"prompt": "a green triangle", "size": "48x32", "num_inference_steps": 3, "seed": 2},
            [(2, dict(prompt="a green triangle", height=32, width=48, num_inference_steps=3, guidance_scale=3.5))],
        ),
    ],
    "qwen-image": [
        (
            {
                "prompt": "a red circle on a blue background",
                "negative_prompt": "bad quality",
                "size": "32x48",
                "num_inference_steps": 3,
                "guidance_scale": 3.0,
                "seed": 21,
            },
            [
                (
                    21,
                    dict(
                        prompt="a red circle on a blue background",
                        negative_prompt="bad quality",
                        height=48,
                        width=32,
                        num_inference_steps=3,
                        true_cfg_scale=3.0,
                    ),
                )
            ],
        ),
        (
            {"prompt": "dog", "size": "32x48", "num_inference_steps": 2, "seed": 4},
            [
                (
                    4,
                    dict(
                        prompt="dog",
                        negative_prompt=" ",
                        height=48,
                        width=32,
                        num_inference_steps=2,
                        true_cfg_scale=4.0,
                    ),
                )
            ],
        ),
    ],
}


@pytest.fixture(scope="module")
def family_server(family_dirs, server_factory):
    """``family_server(family)``: one real ``omni-server serve DIR`` per family for this module, on loopback."""
    started = {}

    def get(family: str):
        if family not in started:
            started[family] = server_factory(str(family_dirs[family]), "--served-model-name", family)
        return started[family]

    yield get
    for handle in started.values():
        handle.stop()


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_http_api_draws_what_diffusers_draws_for_concurrent_requests(family, family_dirs, family_server, tools) -> None:
    server = family_server(family)
    with server.client(timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]
        assert (model["id"], model["family"]) == (family, family)
        multiple = model["size_range"]["multiple"]
        assert model["size_range"]["min_side"] == multiple and "true_cfg_scale" in model["accepts"]
        assert (model["max_inference_steps"], model["max_images_per_request"]) == (1000, 10)
        # Any multiple of the pixel granularity within the limits; anything else is a 400 naming `size`.
        for size in (f"{multiple + 1}x32", f"32x{model['size_range']['max_side'] + multiple}"):
            error = client.post("/v1/images/generations", json={"prompt": "a cat", "size": size}).json()["error"]
            assert error["param"] == "size" and str(multiple) in error["message"], error
        bodies = [body for body, _ in HTTP_CASES[family]]
        keys = [f"progress-{family}-{i}" for i in range(len(bodies))]
        responses = _post_all(client, bodies, [{"X-Omni-Progress-Key": key} for key in keys])
        images = [image for response in responses for image in _images(response)]
        for key, body in zip(keys, bodies, strict=True):
            state = client.get(f"/v1/progress/{key}").json()
            assert state == {
                "key": key,
                "status": "done",
                "step": body["num_inference_steps"],
                "total": body["num_inference_steps"],
            }, state
        assert client.get("/v1/progress/never-sent-key").status_code == 404
    reference = _reference(family, family_dirs[family])
    expected = [_expected(reference, seed, **kwargs) for _, calls in HTTP_CASES[family] for seed, kwargs in calls]
    _check(tools.psnr, f"{family} HTTP API", images, expected)


def test_offload_equals_plain_exactly_and_fp8_stays_within_its_bound(family_dirs, tools, tmp_path) -> None:
    """Through ``omni-server generate``: layerwise offload gives the plain image byte for byte; FP8 (the family's
    ignore list) stays within 35 dB of it (the bound tests/omni_models holds the pipeline to), FP8 attention within
    45 dB."""

    def generate(name: str, *flags: str) -> Image.Image:
        out = tmp_path / f"{name}.png"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "omni_server",
                "generate",
                "a red circle on a blue background",
                "--model",
                str(family_dirs["flux"]),
                "--device",
                "cpu",
                "--steps",
                "3",
                "--size",
                "32x32",
                "--image-seed",
                "9",
                "--negative-prompt",
                "bad quality",
                "--true-cfg-scale",
                "3",
                "-o",
                str(out),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr
        return Image.open(out)

    # The plain image from the family's pipeline in this process: what `generate` without the flags writes (the
    # generate tests above hold the CLI to diffusers), one process fewer.
    plain = omni_models.load(str(family_dirs["flux"]), device="cpu", dtype=torch.float32)(
        "a red circle on a blue background",
        negative_prompt="bad quality",
        true_cfg_scale=3.0,
        num_inference_steps=3,
        height=32,
        width=32,
        seed=9,
    )[0]
    offload = generate("offload", "--enable-layerwise-offload")
    assert offload.tobytes() == plain.tobytes()
    fp8 = generate("fp8", "--quantization", "fp8", "--fp8-cache-dir", str(tmp_path / "fp8-cache"))
    figure = tools.psnr(fp8, plain)
    print(f"flux FP8 vs fp32 through generate: {figure:.1f} dB")
    assert figure >= 35.0
    # --attention-dtype fp8: the attention in FP8, the linears in fp32 (tests/omni_models/test_fp8_attention.py).
    attention = generate("fp8-attention", "--attention-dtype", "fp8")
    figure = tools.psnr(attention, plain)
    print(f"flux FP8 attention vs fp32 through generate: {figure:.1f} dB")
    assert attention.tobytes() != plain.tobytes() and figure >= 45.0  # 52.8 dB on the 2-core machine


def test_playground_offers_the_family_fields_shows_progress_keeps_a_gallery_and_clears_on_failure(
    family_server, browser, family_dirs, tools
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = family_server("flux")
    driver = browser
    driver.get(server.url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "family").text == "(flux, flux.1-dev)")
    for field in ("prompt", "negative", "size", "steps", "guidance", "true-cfg", "n", "seed"):
        assert driver.find_element(By.ID, field).is_displayed(), field
    assert "multiples of" in driver.find_element(By.ID, "size-rule").text

    def fill(**values: str) -> None:
        for field, value in values.items():
            element = driver.find_element(By.ID, field)
            element.clear()
            element.send_keys(value)
        driver.find_element(By.ID, "generate").click()

    fill(
        prompt="a photo of a cat in the snow",
        negative="blurry",
        size="32x32",
        steps="3",
        guidance="3.5",
        **{"true-cfg": "2"},
        n="2",
        seed="5",
    )
    WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith("Done"))
    assert driver.find_element(By.ID, "status").text == "Done (3/3 steps)."
    progress = driver.find_element(By.ID, "progress")
    assert (progress.get_attribute("value"), progress.get_attribute("max")) == ("3", "3")
    figures = driver.find_elements(By.CSS_SELECTOR, "#gallery figure")
    assert len(figures) == 2
    captions = [f.find_element(By.TAG_NAME, "figcaption").text for f in figures]
    assert all("negative_prompt: blurry" in c and "size: 32x32" in c and "true_cfg_scale: 2" in c for c in captions)
    assert sorted(c.rsplit("image_seed: ", 1)[1] for c in captions) == ["5", "6"]
    # The shown image is diffusers' image for seed 5 (decoded from the page's data URL).
    src = driver.find_element(By.ID, "result").get_attribute("src")
    shown = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    expected = _expected(
        _reference("flux", family_dirs["flux"]),
        5,
        prompt="a photo of a cat in the snow",
        negative_prompt="blurry",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.5,
        true_cfg_scale=2.0,
    )
    assert tools.psnr(shown, expected) >= TARGET_DB
    # A failing request clears the old image and names the field; the gallery keeps this session's images.
    fill(size="33x32")
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "status").text.startswith("Error"))
    assert driver.find_element(By.ID, "status").text.startswith("Error: size: size 33x32 is not supported")
    result = driver.find_element(By.ID, "result")
    assert not result.is_displayed() and not result.get_attribute("src")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#gallery figure")) == 2
