"""Qwen-Image-Edit-2509 (issue 28): ``QwenImageEditPlusPipeline`` through ``POST /v1/images/edits`` and ``generate``.

A tiny random-weight checkpoint is written here (``omni_models.synthetic.qwen_image_edit_components``: diffusers and
transformers classes, the tokenizer and the Qwen2-VL processor built by the code, ``save_pretrained``; the VAE's
``sample_size`` 64 makes omni encode the references at 64² instead of 1024²). The official OpenAI SDK is the client
of one real ``omni-server serve`` process (warm-up on: an edit-only model warms up with an input image), ``omni-server
generate`` a real subprocess, and diffusers' own ``QwenImageEditPlusPipeline`` the reference at
``generator=torch.Generator("cpu").manual_seed(seed)`` (target: PSNR >= 40 dB, fp32). omni's decisions are given to
diffusers: its reference areas (``CONDITION_IMAGE_SIZE`` and ``VAE_IMAGE_SIZE``, set to the scaled ones for the tiny
checkpoint), the output size, the negative prompt " " (Qwen-Image's default true CFG).

No torchvision here: diffusers' pipeline gets omni's torchvision-free Qwen2-VL processor (transformers' own
processor needs torchvision's video processor); ``test_processor_equals_transformers_torchvision_processor`` checks
that processor against transformers' torchvision one wherever torchvision loads.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from edit_inputs import noise, png
from PIL import Image

diffusers = pytest.importorskip("diffusers")

TARGET_DB = 40.0
NATIVE = 64  # the tiny checkpoint's native side (VAE sample_size)


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_models import synthetic

    directory = tmp_path_factory.mktemp("qwen-image-edit")
    return synthetic.save_checkpoint("qwen-image-edit-plus", synthetic.qwen_image_edit_components("tiny"), directory)


@pytest.fixture(scope="module")
def reference(edit_dir):
    """diffusers' pipeline from the checkpoint, with omni's processor and reference areas."""
    import transformers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from omni_models.backends.qwen_image_edit import reference_areas
    from omni_models.diffusers_adapter import qwen2_vl_processor

    processor = qwen2_vl_processor(transformers.Qwen2Tokenizer.from_pretrained(str(edit_dir / "processor")))
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(str(edit_dir), processor=processor, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    saved = plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE
    plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = reference_areas(NATIVE)
    yield pipe
    plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = saved


def _expected(pipe, images, seeds, height: int, width: int, **kwargs) -> list[Image.Image]:
    """diffusers' images for one omni request (its ``n`` images in one call, one generator per image)."""
    kwargs = {"negative_prompt": " ", "true_cfg_scale": 4.0, **kwargs}
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    return pipe(
        image=list(images), generator=generators, height=height, width=width, num_images_per_prompt=len(seeds), **kwargs
    ).images


def _check(psnr, label: str, images, expected) -> None:
    figures = [psnr(a, b) for a, b in zip(images, expected, strict=True)]
    print(f"{label}: PSNR vs diffusers {[round(f, 1) for f in figures]} dB")
    assert min(figures) >= TARGET_DB, figures


# --- the processor and the reference geometry, without a server ---------------------------------------------------


def test_reference_geometry_is_diffusers() -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from omni_models.backends import qwen_image_edit as edit

    assert (edit.CONDITION_IMAGE_SIZE, edit.VAE_IMAGE_SIZE) == (plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE)
    assert edit.reference_areas(1024) == (plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE)
    for area in (plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE, 64 * 64):
        for ratio in (1.0, 40 / 24, 0.5, 16 / 9, 3 / 7):
            assert edit.calculate_dimensions(area, ratio) == plus.calculate_dimensions(area, ratio)


def test_the_checkpoint_is_inspected_from_metadata_and_a_bad_processor_folder_is_named(edit_dir, tmp_path) -> None:
    import json
    import shutil

    from omni_models import CheckpointError, inspect, load

    spec = inspect(str(edit_dir))
    assert (spec.kind, spec.info.variant, spec.capabilities.lora) == (
        "qwen-image-edit-plus",
        "qwen-image-edit-plus",
        True,
    )
    broken = shutil.copytree(edit_dir, tmp_path / "broken")
    config = broken / "processor" / "processor_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in settings.items() if k != "image_processor"}))
    with pytest.raises(CheckpointError, match="no image_processor settings") as raised:
        load(str(broken))
    assert str(raised.value).startswith(str(config))
    config.unlink()
    with pytest.raises(CheckpointError, match="missing") as raised:
        inspect(str(broken))  # the preflight reads the processor folder before anything is loaded
    assert str(raised.value).startswith(str(config))


def test_processor_equals_transformers_torchvision_processor(edit_dir) -> None:
    """The torchvision-free processor's ``input_ids``, ``pixel_values`` and ``image_grid_thw`` are transformers'
    torchvision processor's, bit for bit (resizes up and down, odd aspect ratios). Skipped where torchvision does
    not load (CI: PyPI's wheels crash beside the CPU torch)."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    except Exception as exc:  # ImportError, or the RuntimeError of a torchvision built for another torch
        pytest.skip(f"torchvision does not load here ({type(exc).__name__}: {exc})")
    import transformers

    from omni_models.diffusers_adapter import qwen2_vl_processor

    tokenizer = transformers.Qwen2Tokenizer.from_pretrained(str(edit_dir / "processor"))
    ours = qwen2_vl_processor(tokenizer)
    real = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )
    text = ["Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|>"]
    for width, height in ((384, 384), (40, 24), (100, 60), (333, 500), (56, 56), (1000, 700), (13, 300)):
        images = [noise(width, height, 0), noise(height, width, 1)]
        a = real(text=text, images=images, return_tensors="pt")
        b = ours(text=text, images=images, return_tensors="pt")
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key]), (width, height, key)


def test_image_conditioning_is_computed_once_per_request_and_freed(edit_dir) -> None:
    from omni_models import GenerationRequest, InputImage, InvalidRequestError, load, resolve_request

    pipe = load(str(edit_dir))
    info = pipe.info
    assert (info.family, info.image.min_input_images, info.image.max_input_images) == ("qwen-image-edit", 1, 3)
    for images, words in (((), "image is required"), ((InputImage.from_pil(noise(8, 8, 0)),) * 4, "at most 3")):
        with pytest.raises(InvalidRequestError, match=words) as raised:
            resolve_request(info, GenerationRequest(prompt="a cat", images=images))
        assert raised.value.param == "image"
    images = (InputImage.from_pil(noise(40, 24, 1)), InputImage.from_pil(noise(16, 32, 2)))
    resolved = resolve_request(info, GenerationRequest(prompt="a red cat", n=2, images=images, seed=1))
    assert (resolved.width, resolved.height, resolved.negative_prompt) == (40, 24, " ")  # size auto: the first's
    jobs = pipe.prepare(resolved)
    reference = jobs[0].reference
    assert jobs[1].reference is reference and jobs[0].guided  # true CFG by default
    # The VAE area (64² here) at each image's aspect ratio (diffusers' arithmetic), through the 4x VAE.
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    sizes = [calculate_dimensions(NATIVE * NATIVE, image.width / image.height) for image in images]
    assert reference.latent_shapes == tuple((h // 4, w // 4) for w, h in sizes) == ((16, 24), (24, 8))
    text_encoder = pipe.backend.pipeline.text_encoder
    calls = {"vision": 0, "vae": 0}
    visual, vae_encode = text_encoder.model.visual.forward, pipe.backend.pipeline.vae.encode

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    text_encoder.model.visual.forward = count("vision", visual)
    pipe.backend.pipeline.vae.encode = count("vae", vae_encode)
    try:
        pipe.start(jobs)
        pipe.start(jobs)  # started already: nothing is encoded again
        for _ in range(2):
            pipe.step(jobs)
    finally:
        del text_encoder.model.visual.forward, pipe.backend.pipeline.vae.encode
    # One vision-tower pass for both images and both prompts (cond and uncond) of the 2 jobs; one VAE encode each.
    assert calls == {"vision": 1, "vae": 2}
    assert reference.latents.shape == (8 * 12 + 12 * 4, 16) and reference.pixels is None
    assert jobs[0].conditioning.cond.tokens.shape != jobs[0].conditioning.uncond.tokens.shape  # ragged text
    pipe.release(jobs)
    assert reference.latents is None and reference.vision_features is None and reference.vision_inputs is None


# --- the product: one server, the OpenAI SDK, the CLI ---------------------------------------------------------------


@pytest.fixture(scope="module")
def edit_server(edit_dir, server_factory):
    handle = server_factory(str(edit_dir), "--served-model-name", "qwen-edit")  # warm-up on
    yield handle
    handle.stop()


def _decoded(response) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB") for item in response.data]


def test_openai_sdk_edits_draw_what_diffusers_draws(edit_server, reference, tools) -> None:
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{edit_server.url}/v1", api_key="unused", timeout=300)
    one = noise(40, 24, 3)
    first, second = noise(24, 24, 4), noise(16, 32, 5)
    results: dict[str, object] = {}
    calls = {
        # one image, size auto, n=2, the default true CFG (negative " ", scale 4)
        "one": lambda: client.images.edit(
            image=("one.png", png(one), "image/png"),
            prompt="a red circle",
            n=2,
            size="auto",
            extra_body={"num_inference_steps": 2, "seed": 7},
        ),
        # two images (image[]), an explicit size, omni's guidance extensions
        "two": lambda: client.images.edit(
            image=[("a.png", png(first), "image/png"), ("b.png", png(second), "image/png")],
            prompt="a blue square",
            size="48x32",
            extra_body={"num_inference_steps": 2, "seed": 9, "negative_prompt": "blurry", "guidance_scale": 3.0},
        ),
    }
    threads = [threading.Thread(target=lambda k=k, c=c: results.__setitem__(k, c())) for k, c in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert (len(results["one"].data), results["one"].size) == (2, "40x24")
    assert (len(results["two"].data), results["two"].size) == (1, "48x32")
    expected = [
        *_expected(reference, [one], [7, 8], 24, 40, prompt="a red circle", num_inference_steps=2),
        *_expected(
            reference,
            [first, second],
            [9],
            32,
            48,
            prompt="a blue square",
            num_inference_steps=2,
            negative_prompt="blurry",
            true_cfg_scale=3.0,
        ),
    ]
    _check(tools.psnr, "qwen-image-edit (OpenAI SDK)", [*_decoded(results["one"]), *_decoded(results["two"])], expected)
    # An edit-only model: text to image and too many images are refused by name.
    with pytest.raises(BadRequestError) as raised:
        client.images.generate(prompt="a cat", size="32x32")
    assert raised.value.body["param"] == "image" and "image is required" in raised.value.body["message"]
    with pytest.raises(BadRequestError) as raised:
        client.images.edit(image=[("a.png", png(first), "image/png")] * 4, prompt="x")
    assert raised.value.body["param"] == "image"
    with pytest.raises(NotFoundError) as raised:  # a server without --enable-lora serves no adapter
        client.images.edit(image=("a.png", png(first), "image/png"), prompt="x", model="shift")
    assert raised.value.body["param"] == "model"


def test_an_edit_with_a_step_cache_draws_what_the_pipeline_draws_with_it(edit_server, edit_dir, tools) -> None:
    """``cache`` on a Qwen-Image-Edit edit (ragged text, two references, true CFG): the server's decisions and image
    are the pipeline's own step-cache path's."""
    from openai import OpenAI

    from omni_models import GenerationRequest, InputImage, load, resolve_request

    client = OpenAI(base_url=f"{edit_server.url}/v1", api_key="unused", timeout=300)
    images = [noise(24, 24, 41), noise(16, 32, 42)]
    cache = '{"method": "mask", "mask": "medium", "warmup_steps": 1}'
    raw = client.images.with_raw_response.edit(
        image=[(f"{i}.png", png(image), "image/png") for i, image in enumerate(images)],
        prompt="a green cat",
        size="32x32",
        extra_body={"num_inference_steps": 6, "seed": 2, "cache": cache},
    )
    usage = raw.http_response.json()["usage"]["step_cache"]
    assert [u["decisions"] for u in usage] == ["CCSCSC"]
    pipe = load(str(edit_dir))
    request = GenerationRequest(
        prompt="a green cat",
        images=tuple(InputImage.from_pil(image) for image in images),
        height=32,
        width=32,
        num_inference_steps=6,
        seed=2,
        cache={"method": "mask", "mask": "medium", "warmup_steps": 1},
    )
    jobs = pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    assert jobs[0].step_cache.stats().decisions == "CCSCSC"
    _check(tools.psnr, "qwen-image-edit with a step cache vs the pipeline's", _decoded(raw.parse()), pipe.decode(jobs))


def test_generate_cli_edits_two_images_like_diffusers(edit_dir, reference, tools, tmp_path) -> None:
    first, second = noise(16, 32, 6), noise(32, 16, 7)
    first.save(tmp_path / "first.png")
    second.save(tmp_path / "second.png")
    out = tmp_path / "out.png"
    command = [sys.executable, "-m", "omni_server", "generate", "a yellow triangle", "--model", str(edit_dir)]
    command += ["--device", "cpu", "--image", str(tmp_path / "first.png"), "--image", str(tmp_path / "second.png")]
    command += ["--steps", "2", "--image-seed", "3", "-n", "2", "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    paths = [Path(line) for line in result.stdout.split()]
    # No --size: the output takes the first input's size (16x32).
    expected = _expected(reference, [first, second], [3, 4], 32, 16, prompt="a yellow triangle", num_inference_steps=2)
    _check(tools.psnr, "qwen-image-edit generate --image x2", [Image.open(p).convert("RGB") for p in paths], expected)


# --- FP8 and layerwise offload (CPU) ---------------------------------------------------------------------------------

FP8_PSNR_BOUND_DB = 35.0  # an FP8 edit against the fp32 edit, same seed (the families' text-to-image bound)


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_models import synthetic

    directory = tmp_path_factory.mktemp("flux-kontext")
    return synthetic.save_checkpoint("flux-kontext", synthetic.flux_components("tiny"), directory)


def _edit(pipe, images):
    from omni_models import GenerationRequest, InputImage, resolve_request

    request = GenerationRequest(
        prompt="a red circle",
        negative_prompt="blurry",
        true_cfg_scale=3.0,
        guidance_scale=3.0,
        images=tuple(InputImage.from_pil(image) for image in images),
        num_inference_steps=3,
        seed=4,
        n=2,
    )
    jobs = pipe.prepare(resolve_request(pipe.info, request))
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    images = pipe.decode(jobs)
    pipe.release(jobs)
    return images


@pytest.mark.parametrize("family", ["qwen-image-edit", "flux-kontext"])
def test_edits_under_layerwise_offload_and_fp8_equal_the_plain_edit(family, edit_dir, kontext_dir, tools) -> None:
    """Layerwise offload: the same bytes (two input images, n=2, true CFG); FP8 (``--quantization fp8``'s load):
    within ``FP8_PSNR_BOUND_DB`` of the fp32 edit."""
    from omni_models import load

    directory = str(edit_dir if family == "qwen-image-edit" else kontext_dir)
    images = [noise(40, 24, 21), noise(16, 32, 22)]
    plain = _edit(load(directory), images)
    offloaded_pipe = load(directory, layerwise_offload=True)
    assert offloaded_pipe.offload is not None
    offloaded = _edit(offloaded_pipe, images)
    assert [image.tobytes() for image in offloaded] == [image.tobytes() for image in plain]
    fp8_pipe = load(directory, quantization="fp8")
    assert fp8_pipe.fp8 is not None and fp8_pipe.fp8.quantized
    fp8 = _edit(fp8_pipe, images)
    figures = [tools.psnr(a, b) for a, b in zip(fp8, plain, strict=True)]
    print(f"{family} FP8 edit vs fp32: {[round(f, 1) for f in figures]} dB")
    assert min(figures) >= FP8_PSNR_BOUND_DB, figures


# --- Qwen-Image-Edit (the first release, one image) ------------------------------------------------------------------


def test_qwen_image_edit_v1_draws_what_diffusers_draws(tmp_path, monkeypatch, tools) -> None:
    """``QwenImageEditPipeline``: one image, read by Qwen2.5-VL and the VAE at the VAE area (1024² in diffusers,
    a fixed call inside its ``__call__``: the test scales diffusers' ``calculate_dimensions`` to the tiny
    checkpoint's 64² area), n=2 with true CFG, against diffusers at the same seeds."""
    import transformers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as v1

    from omni_models import GenerationRequest, InputImage, InvalidRequestError, load, resolve_request, synthetic
    from omni_models.diffusers_adapter import qwen2_vl_processor

    directory = synthetic.save_checkpoint("qwen-image-edit", synthetic.qwen_image_edit_components("tiny"), tmp_path)
    pipe = load(str(directory))
    assert (pipe.info.variant, pipe.info.image.max_input_images) == ("qwen-image-edit", 1)
    image = noise(40, 24, 31)
    with pytest.raises(InvalidRequestError, match="at most 1") as raised:
        resolve_request(pipe.info, GenerationRequest(prompt="x", images=(InputImage.from_pil(image),) * 2))
    assert raised.value.param == "image"
    served = pipe(
        "a red circle",
        image=image,
        negative_prompt="blurry",
        guidance_scale=3.0,
        num_inference_steps=2,
        seed=5,
        num_images_per_prompt=2,
    )
    calculate = v1.calculate_dimensions
    monkeypatch.setattr(v1, "calculate_dimensions", lambda area, ratio: calculate(area * (NATIVE / 1024) ** 2, ratio))
    processor = qwen2_vl_processor(transformers.Qwen2Tokenizer.from_pretrained(str(directory / "processor")))
    reference = diffusers.QwenImageEditPipeline.from_pretrained(str(directory), processor=processor)
    reference.set_progress_bar_config(disable=True)
    expected = reference(
        image=image,
        prompt="a red circle",
        negative_prompt="blurry",
        true_cfg_scale=3.0,
        num_inference_steps=2,
        height=24,
        width=40,
        num_images_per_prompt=2,
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in (5, 6)],
    ).images
    _check(tools.psnr, "qwen-image-edit (v1)", served, expected)
