"""Image editing (issue 28): FLUX.1-Kontext through ``POST /v1/images/edits`` and ``generate --image``.

A tiny random-weight FLUX.1-Kontext checkpoint is written here (diffusers classes, tokenizers from
``omni_models.synthetic``, ``save_pretrained``); the official OpenAI SDK is the client of one real ``omni-server
serve`` process, ``omni-server generate`` a real subprocess, and diffusers' own ``FluxKontextPipeline`` the reference
at ``generator=torch.Generator("cpu").manual_seed(seed)`` (target: PSNR >= 40 dB, fp32). omni's decisions are given
to diffusers as its own arguments: ``max_area=height * width`` (the request's size), ``_auto_resize=False`` with the
reference already at omni's resolution (``reference_size``: the preferred Kontext resolution scaled to the native
side, through diffusers' own ``image_processor.resize``), several inputs side by side as one image.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from edit_inputs import noise, png
from PIL import Image

diffusers = pytest.importorskip("diffusers")

TARGET_DB = 40.0
SERVER_FLAGS = ("--max-input-image-bytes", "20000", "--max-input-image-pixels", "4096", "--no-warmup")


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_models import synthetic

    directory = tmp_path_factory.mktemp("flux-kontext")
    return synthetic.save_checkpoint("flux-kontext", synthetic.flux_components("tiny"), directory)


@pytest.fixture(scope="module")
def reference(kontext_dir):
    pipe = diffusers.FluxKontextPipeline.from_pretrained(str(kontext_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _expected(pipe, image: Image.Image, seed: int, height: int, width: int, **kwargs) -> Image.Image:
    """diffusers' image for omni's call: ``image`` is the reference as omni encodes it (resized by diffusers)."""
    from omni_models.backends.flux_kontext import reference_size

    ref_h, ref_w = reference_size(image.height, image.width, native_side=32, multiple=2)
    image = pipe.image_processor.resize(image, ref_h, ref_w)
    return pipe(
        image=image,
        generator=torch.Generator("cpu").manual_seed(seed),
        height=height,
        width=width,
        max_area=height * width,
        _auto_resize=False,
        **kwargs,
    ).images[0]


def _check(psnr, label: str, images, expected) -> None:
    figures = [psnr(a, b) for a, b in zip(images, expected, strict=True)]
    print(f"{label}: PSNR vs diffusers {[round(f, 1) for f in figures]} dB")
    assert min(figures) >= TARGET_DB, figures


# --- inputs: decoded and checked once, without a model ----------------------------------------------------------


def test_input_images_are_converted_where_faithful_and_refused_by_name_otherwise() -> None:
    from omni_models import InvalidRequestError, decode_input_image

    def decode(data: bytes, **limits):
        return decode_input_image(data, **{"max_bytes": 10**6, "max_pixels": 10**6, **limits})

    rgb = noise(8, 6, 0)
    assert decode(png(rgb)).to_pil().tobytes() == rgb.tobytes()
    opaque = rgb.convert("RGBA")
    assert decode(png(opaque)).pixels == rgb.tobytes()  # fully opaque alpha is dropped
    gray16 = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    assert set(decode(png(gray16)).pixels) == {255}  # 16-bit grayscale scaled to 8 bits, not clipped
    cmyk = decode(png(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), format="JPEG", quality=100))
    assert cmyk.to_pil().getpixel((0, 0))[0] > 200  # CMYK red reads as RGB red
    transparent = opaque.copy()
    transparent.putpixel((0, 0), (0, 0, 0, 0))
    frames = [noise(4, 4, i) for i in range(2)]
    animation = io.BytesIO()
    frames[0].save(animation, format="GIF", save_all=True, append_images=frames[1:])
    for data, limits, words in (
        (b"", {}, "empty"),
        (b"not an image at all", {}, "not an image"),
        (png(rgb)[:60], {}, "corrupt"),
        (png(rgb), {"max_bytes": 10}, "--max-input-image-bytes"),
        (png(rgb), {"max_pixels": 47}, "--max-input-image-pixels"),
        (png(transparent), {}, "transparent"),
        (animation.getvalue(), {}, "animation"),
    ):
        with pytest.raises(InvalidRequestError, match=words) as raised:
            decode(data, **limits)
        assert raised.value.param == "image"


def test_reference_resolution_is_diffusers_auto_resize_at_the_native_side() -> None:
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    from omni_models.backends.flux_kontext import PREFERRED_RESOLUTIONS, reference_size

    assert PREFERRED_RESOLUTIONS == tuple(PREFERRED_KONTEXT_RESOLUTIONS)
    for height, width in ((1024, 1024), (768, 1360), (1500, 600), (333, 333), (720, 1280)):
        aspect = width / height
        _, w, h = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        assert reference_size(height, width, native_side=1024, multiple=16) == (h // 16 * 16, w // 16 * 16)
    assert reference_size(24, 40, native_side=32, multiple=2) == (26, 42)  # 1328x800 scaled by 32/1024


def test_requests_with_images_are_checked_against_the_model(kontext_dir) -> None:
    from omni_models import GenerationRequest, InputImage, InvalidRequestError, inspect, resolve_request

    info = inspect(str(kontext_dir)).info
    assert ("image" in info.accepts, info.image.max_input_images, info.family) == (True, 4, "flux-kontext")
    image = InputImage.from_pil(noise(40, 24, 0))
    resolved = resolve_request(info, GenerationRequest(prompt="a cat", images=(image,)))
    assert (resolved.width, resolved.height) == (40, 24)  # size auto: the first input's, fitted to the model
    large = InputImage.from_pil(noise(301, 99, 0))
    resolved = resolve_request(info, GenerationRequest(prompt="a cat", images=(large,)))
    assert (resolved.width, resolved.height) == (64, 22)  # scaled into max_side 64, rounded to multiples of 2
    with pytest.raises(InvalidRequestError, match="at most 4") as raised:
        resolve_request(info, GenerationRequest(prompt="a cat", images=(image,) * 5))
    assert raised.value.param == "image"
    text_only = msgspec_replace_accepts(info)
    with pytest.raises(InvalidRequestError, match="does not use image") as raised:
        resolve_request(text_only, GenerationRequest(prompt="a cat", images=(image,)))
    assert raised.value.param == "image"


def msgspec_replace_accepts(info):
    import msgspec

    return msgspec.structs.replace(info, accepts=tuple(a for a in info.accepts if a != "image"))


def test_reference_is_encoded_once_per_request_shared_by_its_jobs_and_freed_at_release(kontext_dir) -> None:
    from omni_models import GenerationRequest, InputImage, load, resolve_request

    pipe = load(str(kontext_dir))
    image = InputImage.from_pil(noise(32, 32, 1))
    edit = pipe.prepare(resolve_request(pipe.info, GenerationRequest(prompt="a cat", n=2, images=(image,), seed=1)))
    text = pipe.prepare(resolve_request(pipe.info, GenerationRequest(prompt="a dog", seed=2)))
    assert edit[0].reference is edit[1].reference and text[0].reference is None
    assert not edit[0].request.images  # the pixels live on the shared reference, not on each job
    # 256 output + 256 reference tokens: an edit row counts twice in a forward's row budget.
    assert (edit[0].num_rows, text[0].num_rows) == (2, 1)
    pipe.start([*edit, *text])
    latents = edit[0].reference.latents
    assert latents.shape == (256, 16) and edit[0].reference.pixels is None
    pipe.start(edit)  # started already: nothing is encoded again
    assert edit[1].reference.latents is latents
    pipe.step([*edit, *text])  # one forward per sequence layout: edits together, the text job alone
    assert all(job.step_index == 1 for job in (*edit, *text))
    pipe.release(edit)
    assert edit[0].reference.latents is None and edit[0].reference.ids is None


# --- the product: one server, the OpenAI SDK, the CLI -------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(kontext_dir, tmp_path_factory) -> Path:
    """A random PEFT LoRA on the Kontext transformer's attention and MLP linears (diffusers' file format)."""
    pytest.importorskip("peft")
    from omni_models import synthetic

    transformer = diffusers.FluxTransformer2DModel.from_pretrained(str(kontext_dir / "transformer"))
    modules = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]
    state, config = synthetic.random_lora(transformer, rank=4, target_modules=modules, seed=1, std=0.3)
    directory = tmp_path_factory.mktemp("kontext-lora")
    return synthetic.save_lora("flux-kontext", directory, state, config)


@pytest.fixture(scope="module")
def kontext_server(kontext_dir, adapter, server_factory):
    lora = ("--enable-lora", "--lora-modules", f"shift={adapter}")
    handle = server_factory(str(kontext_dir), "--served-model-name", "kontext", *lora, *SERVER_FLAGS)
    yield handle
    handle.stop()


def _decoded(response) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB") for item in response.data]


def test_openai_sdk_edits_draw_what_diffusers_draws(kontext_server, reference, tools) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{kontext_server.url}/v1", api_key="unused", timeout=300)
    one = noise(40, 24, 3)
    left, right = noise(16, 32, 4), noise(16, 32, 5)
    results: dict[str, object] = {}

    def run(key: str, call) -> None:
        results[key] = call()

    calls = {
        # one image, size auto, n=2, true CFG through omni's extensions
        "one": lambda: client.images.edit(
            image=("one.png", png(one), "image/png"),
            prompt="a red circle",
            n=2,
            size="auto",
            response_format="b64_json",
            output_format="png",
            extra_body={
                "num_inference_steps": 2,
                "seed": 7,
                "guidance_scale": 3.0,
                "negative_prompt": "blurry",
                "true_cfg_scale": 2.0,
            },
        ),
        # two images (image[]), an explicit size
        "two": lambda: client.images.edit(
            image=[("l.png", png(left), "image/png"), ("r.png", png(right), "image/png")],
            prompt="a blue square",
            size="48x32",
            extra_body={"num_inference_steps": 2, "seed": 9},
        ),
        # text to image on the same transformer, at the same time
        "text": lambda: client.images.generate(
            prompt="a green cat", size="32x32", extra_body={"num_inference_steps": 2, "seed": 11}
        ),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert (len(results["one"].data), results["one"].size, results["one"].output_format) == (2, "40x24", "png")
    assert (len(results["two"].data), results["two"].size) == (1, "48x32")
    canvas = Image.new("RGB", (32, 32))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (16, 0))
    one_kwargs = dict(
        prompt="a red circle",
        num_inference_steps=2,
        guidance_scale=3.0,
        negative_prompt="blurry",
        true_cfg_scale=2.0,
    )
    expected = [
        *(_expected(reference, one, 7 + i, 24, 40, **one_kwargs) for i in range(2)),
        _expected(reference, canvas, 9, 32, 48, prompt="a blue square", num_inference_steps=2, guidance_scale=2.5),
    ]
    _check(tools.psnr, "kontext edits (OpenAI SDK)", [*_decoded(results["one"]), *_decoded(results["two"])], expected)
    text = reference(
        prompt="a green cat",
        num_inference_steps=2,
        guidance_scale=2.5,
        height=32,
        width=32,
        max_area=32 * 32,
        generator=torch.Generator("cpu").manual_seed(11),
    ).images[0]
    _check(tools.psnr, "kontext text to image", _decoded(results["text"]), [text])


def test_edits_refuse_what_they_cannot_honour_by_name(kontext_server) -> None:
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{kontext_server.url}/v1", api_key="unused", timeout=60)
    image = ("a.png", png(noise(32, 32, 0)), "image/png")
    for kwargs, param in (
        ({"mask": image}, "mask"),
        ({"response_format": "url"}, "response_format"),
        ({"background": "transparent"}, "background"),
        ({"input_fidelity": "high"}, "input_fidelity"),
        ({"quality": "high"}, "quality"),
        ({"output_format": "gif"}, "output_format"),
        ({"partial_images": 2}, "partial_images"),
        ({"n": 11}, "n"),
        ({"size": "33x32"}, "size"),
        ({"extra_body": {"num_inference_step": 2}}, "num_inference_step"),
        ({"extra_body": {"seed": "x"}}, "seed"),
        ({"image": [image] * 5}, "image"),
        ({"image": ("big.png", png(noise(100, 100, 1)), "image/png")}, "image"),  # > 20000 bytes
        ({"image": ("wide.png", png(noise(65, 64, 1)), "image/png")}, "image"),  # > 4096 pixels
        ({"image": ("x.png", b"GIF89a broken", "image/png")}, "image"),
    ):
        with pytest.raises(BadRequestError) as raised:
            client.images.edit(**{"image": image, "prompt": "x", **kwargs})
        error = raised.value.body
        assert error["param"] == param, (kwargs.keys(), error)
    with httpx.Client(base_url=kontext_server.url, timeout=60) as http:
        files = [("image", image)]
        for data, files_, param in (
            ({"prompt": "x", "n": "1"}, [*files, ("prompt", ("p.txt", b"x", "text/plain"))], "prompt"),  # a file
            ({}, [("prompt", (None, b"x"))], "image"),  # a form without a file part
            ({}, files, "prompt"),
        ):
            response = http.post("/v1/images/edits", data=data, files=files_)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        transparent = noise(8, 8, 0).convert("RGBA")
        transparent.putpixel((0, 0), (0, 0, 0, 0))
        response = http.post(
            "/v1/images/edits", data={"prompt": "x"}, files=[("image", ("t.png", png(transparent), "image/png"))]
        )
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "image" and "transparent" in error["message"]


def test_edits_run_the_step_cache_as_the_engine_level_path_does(kontext_server, kontext_dir, tools) -> None:
    """``cache`` on the edits route (a JSON object of knobs in a form field): the edit skips the middle blocks on the
    steps the policy caches (``usage.step_cache``) and draws what the pipeline's own step-cache path draws."""
    from openai import BadRequestError, OpenAI

    from omni_models import GenerationRequest, InputImage, load, resolve_request

    client = OpenAI(base_url=f"{kontext_server.url}/v1", api_key="unused", timeout=300)
    image = noise(32, 32, 11)
    cache = {"method": "mask", "mask": "medium", "warmup_steps": 1}
    raw = client.images.with_raw_response.edit(
        image=("a.png", png(image), "image/png"),
        prompt="a red circle",
        extra_body={"num_inference_steps": 6, "seed": 5, "cache": json.dumps(cache)},
    )
    usage = raw.http_response.json()["usage"]["step_cache"]
    assert [u["decisions"] for u in usage] == ["CCSCSC"] and usage[0]["block_fraction"] < 1.0
    served = _decoded(raw.parse())
    pipe = load(str(kontext_dir))
    request = GenerationRequest(
        prompt="a red circle", images=(InputImage.from_pil(image),), num_inference_steps=6, seed=5, cache=cache
    )
    jobs = pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    assert jobs[0].step_cache.stats().decisions == "CCSCSC"
    _check(tools.psnr, "kontext edit with a step cache vs the pipeline's", served, pipe.decode(jobs))
    for extra, param in (({"cache": "fastest"}, "cache"), ({"cache": "{not json"}, "cache")):
        with pytest.raises(BadRequestError) as raised:
            client.images.edit(image=("a.png", png(image), "image/png"), prompt="x", extra_body=extra)
        assert raised.value.body["param"] == param, raised.value.body


def test_edits_with_a_lora_adapter_draw_what_diffusers_draws_with_it(kontext_server, kontext_dir, adapter, tools):
    """LoRA on the edits route as on generations: ``model`` names a served adapter, ``lora_scale`` weighs it; the
    image is diffusers' ``FluxKontextPipeline`` after ``load_lora_weights`` + ``set_adapters([name], [scale])``."""
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{kontext_server.url}/v1", api_key="unused", timeout=300)
    image = noise(32, 32, 12)
    kwargs = dict(image=("a.png", png(image), "image/png"), prompt="a blue square")
    body = {"num_inference_steps": 2, "seed": 3}
    edited = _decoded(client.images.edit(model="shift", **kwargs, extra_body={**body, "lora_scale": 0.7}))
    base = _decoded(client.images.edit(**kwargs, extra_body=body))
    pipe = diffusers.FluxKontextPipeline.from_pretrained(str(kontext_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a blue square", num_inference_steps=2, guidance_scale=2.5)
    plain = _expected(pipe, image, 3, 32, 32, **call)
    pipe.load_lora_weights(str(adapter), adapter_name="shift")
    pipe.set_adapters(["shift"], [0.7])
    _check(tools.psnr, "kontext edit with LoRA (OpenAI SDK)", edited, [_expected(pipe, image, 3, 32, 32, **call)])
    _check(tools.psnr, "kontext edit without LoRA beside it", base, [plain])
    assert tools.psnr(edited[0], base[0]) < 30  # the adapter changes the edit
    with pytest.raises(NotFoundError) as raised:
        client.images.edit(model="nope", **kwargs)
    assert raised.value.body["param"] == "model"
    with pytest.raises(BadRequestError) as raised:
        client.images.edit(**kwargs, extra_body={"lora_scale": 0.5})  # a scale without an adapter
    assert raised.value.body["param"] == "lora_scale"


def test_generate_cli_edits_two_images_like_diffusers(kontext_dir, reference, tools, tmp_path) -> None:
    left, right = noise(16, 32, 6), noise(16, 32, 7)
    left.save(tmp_path / "left.png")
    right.save(tmp_path / "right.png")
    out = tmp_path / "out.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "generate",
            "a yellow triangle",
            "--model",
            str(kontext_dir),
            "--device",
            "cpu",
            "--image",
            str(tmp_path / "left.png"),
            "--image",
            str(tmp_path / "right.png"),
            "--steps",
            "2",
            "--image-seed",
            "3",
            "-n",
            "2",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    paths = [Path(line) for line in result.stdout.split()]
    canvas = Image.new("RGB", (32, 32))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (16, 0))
    # No --size: the output takes the first input's size (16x32); the reference is the 32x32 side-by-side canvas.
    expected = [
        _expected(
            reference, canvas, 3 + i, 32, 16, prompt="a yellow triangle", num_inference_steps=2, guidance_scale=2.5
        )
        for i in range(2)
    ]
    _check(tools.psnr, "kontext generate --image x2", [Image.open(p).convert("RGB") for p in paths], expected)
    from omni_server.config import ServerConfig
    from omni_server.generate import GenerateError, read_input_image

    for path, words in ((tmp_path / "missing.png", "cannot read"), (tmp_path / "left.png", "--max-input-image-bytes")):
        with pytest.raises(GenerateError, match=words) as raised:
            read_input_image(str(path), ServerConfig(max_input_image_bytes=100))
        assert str(raised.value).startswith(f"--image {path}")


def test_playground_uploads_images_shows_the_edit_and_keeps_it_with_its_inputs(
    kontext_server, browser, reference, tools, tmp_path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    image = noise(32, 32, 8)
    image.save(tmp_path / "in.png")
    driver = browser
    driver.get(kontext_server.url + "/")
    WebDriverWait(driver, 30).until(
        lambda d: d.find_element(By.ID, "family").text == "(flux-kontext, flux.1-kontext-dev)"
    )
    assert driver.find_element(By.ID, "images").is_displayed()
    driver.find_element(By.ID, "images").send_keys(str(tmp_path / "in.png"))
    for field, value in (("prompt", "a red circle"), ("steps", "2"), ("seed", "4")):
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith(("Done", "Error")))
    assert driver.find_element(By.ID, "status").text == "Done (2/2 steps).", driver.find_element(By.ID, "status").text
    figure = driver.find_element(By.CSS_SELECTOR, "#gallery figure")
    assert len(figure.find_elements(By.CSS_SELECTOR, "img.input")) == 1
    assert "inputs: 1" in figure.find_element(By.TAG_NAME, "figcaption").text
    src = driver.find_element(By.ID, "result").get_attribute("src")
    shown = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")
    expected = _expected(reference, image, 4, 32, 32, prompt="a red circle", num_inference_steps=2, guidance_scale=2.5)
    _check(tools.psnr, "kontext playground edit", [shown], [expected])
