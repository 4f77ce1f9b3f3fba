"""The families through omni's libraries: layerwise offload (dlo_offload, two block lists for FLUX), FP8 (fp8_cache,
online and from its on-disk cache) and regional compilation."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import omni_models
from omni_models import GenerationRequest, resolve_request
from omni_models.backends import flux, qwen_image
from omni_models.integrations import family_offload_plan

pytest.importorskip("diffusers")

FAMILIES = [("flux", "flux_dev_dir"), ("qwen-image", "qwen_image_dir")]
DECLARATIONS = {"flux": flux.FAMILY.declaration, "qwen-image": qwen_image.FAMILY.declaration}
REQUEST = dict(
    prompt="a red circle on a blue background",
    negative_prompt="bad quality",
    true_cfg_scale=3.0,
    num_inference_steps=3,
    seed=9,
    height=16,
    width=16,
    n=2,
)
# Relative L2 error of one transformer forward (cond + uncond rows of a real denoise step), FP8 against fp32, on the
# tiny random-weight configs. Measured: FLUX 6.5% with every linear in FP8, 2.4% with the family ignore list;
# Qwen-Image 3.1% and 0.5%.
FP8_ERROR_BOUND = {"flux": 0.03, "qwen-image": 0.01}
FP8_PSNR_BOUND_DB = 35.0  # FP8 image against the fp32 image, same seed (measured: FLUX 41.5 dB, Qwen-Image 56.5 dB)


def _prepare(pipe, **overrides):
    return pipe.prepare(resolve_request(pipe.info, GenerationRequest(**{**REQUEST, **overrides})))


def _generate(pipe, **overrides):
    jobs = _prepare(pipe, **overrides)
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    return jobs, pipe.decode(jobs)


@pytest.mark.parametrize(("family", "fixture"), FAMILIES)
def test_layerwise_offload_output_equals_the_plain_path_exactly(family, fixture, request):
    from dlo_offload import resolve_plan

    directory = request.getfixturevalue(fixture)
    plain = omni_models.load(str(directory))
    plain_jobs, plain_images = _generate(plain)
    pipe = omni_models.load(str(directory), layerwise_offload=True)
    declaration = DECLARATIONS[family]
    resolved = resolve_plan(pipe.transformer, family_offload_plan(declaration))
    assert [name.rsplit(".", 1)[0] for name in resolved.block_names][::-1][0] == declaration.block_lists[-1]
    assert {name.rsplit(".", 1)[0] for name in resolved.block_names} == set(declaration.block_lists)
    # Every weight is either in a streamed block or in a resident module: nothing is left behind on the host.
    streamed = {id(p) for block in resolved.blocks for p in block.parameters()}
    resident = {id(p) for _, module in resolved.resident_modules for p in module.parameters()}
    assert {id(p) for p in pipe.transformer.parameters()} == streamed | resident
    jobs, images = _generate(pipe)
    for job, plain_job in zip(jobs, plain_jobs, strict=True):
        assert torch.equal(job.latents, plain_job.latents)
    assert [image.tobytes() for image in images] == [image.tobytes() for image in plain_images]
    # Between forwards the streamed blocks hold no weights; the two slots fit the largest block of either list.
    assert all(p.numel() == 0 for block in resolved.blocks for p in block.parameters())
    plain_blocks = resolve_plan(plain.transformer, family_offload_plan(declaration)).blocks
    largest = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in plain_blocks)
    assert largest <= pipe.offload.slot_nbytes < largest + 256 * 64  # the largest block, 256-byte aligned tensors
    assert pipe.offload.resident_nbytes == sum(
        p.numel() * p.element_size() for _, m in resolved.resident_modules for p in m.parameters()
    )
    with pytest.raises(ValueError, match="cannot be combined with layerwise offload"):
        pipe.compile_transformer()


def _rows(pipe):
    (job,) = _prepare(pipe, n=1)
    pipe.start([job])
    rows = [
        omni_models.families.DenoiseRow(job.latents, job.conditioning.cond, job.timesteps[1], None),
        omni_models.families.DenoiseRow(job.latents, job.conditioning.uncond, job.timesteps[1], None),
    ]
    if pipe.info.image.guidance == "embedded":
        rows = [omni_models.families.DenoiseRow(r.latents, r.text, r.timestep, 3.5) for r in rows]
    return rows, job.size


@pytest.mark.parametrize(("family", "fixture"), FAMILIES)
def test_fp8_error_with_and_without_the_family_ignore_list(family, fixture, request):
    from fp8_cache import quantize_model

    pipe = omni_models.load(str(request.getfixturevalue(fixture)))
    rows, size = _rows(pipe)
    reference = pipe.backend.forward(rows, *size)
    errors = {}
    for label, ignore in (("every linear", ()), ("family ignore list", DECLARATIONS[family].fp8_ignore)):
        quantized = copy.deepcopy(pipe.transformer)
        report = quantize_model(quantized, ignore=ignore)
        assert report.quantized
        pipe.backend.transformer = quantized
        try:
            out = pipe.backend.forward(rows, *size)
        finally:
            pipe.backend.transformer = pipe.backend.pipeline.transformer
        errors[label] = float((out - reference).norm() / reference.norm())
    print(f"{family} FP8 relative error: {errors}")
    assert errors["family ignore list"] <= FP8_ERROR_BOUND[family]
    assert errors["every linear"] > 1.5 * errors["family ignore list"]


@pytest.mark.parametrize(("family", "fixture"), FAMILIES)
def test_fp8_online_and_from_the_cache_agree_and_a_warm_start_never_reads_the_transformer_shards(
    family, fixture, request, tmp_path, psnr
):
    source = request.getfixturevalue(fixture)
    directory = tmp_path / "checkpoint"
    shutil.copytree(source, directory)
    _, full = _generate(omni_models.load(str(directory)))
    online = omni_models.load(str(directory), quantization="fp8")
    _, online_images = _generate(online)
    figures = [psnr(a, b) for a, b in zip(online_images, full, strict=True)]
    print(f"{family} FP8 vs fp32 image PSNR: {figures}")
    assert min(figures) >= FP8_PSNR_BOUND_DB
    cache = tmp_path / "fp8-cache"
    cold = omni_models.load(str(directory), quantization="fp8", fp8_cache_dir=cache)  # a miss: builds the cache
    assert (cache / "COMPLETE").is_file()
    assert sorted(cold.fp8.quantized) == sorted(online.fp8.quantized)  # the cache holds what online FP8 swaps
    # Zero the tensor data of the bf16 transformer shards, keeping their headers (the preflight reads those), size
    # and mtime (the cache's fingerprint): a warm start that read the weights would compute with zeros.
    for shard in (directory / "transformer").glob("*.safetensors"):
        stat = shard.stat()
        data = shard.read_bytes()
        header_end = 8 + int.from_bytes(data[:8], "little")
        shard.write_bytes(data[:header_end] + bytes(len(data) - header_end))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    warm = omni_models.load(str(directory), quantization="fp8", fp8_cache_dir=cache)
    _, warm_images = _generate(warm)
    assert [i.tobytes() for i in warm_images] == [i.tobytes() for i in online_images]
    zeroed = omni_models.load(str(directory))  # the bf16 path does read them: its weights are now zeros
    assert all(not p.any() for p in zeroed.transformer.parameters())


def test_regional_compilation_keeps_the_images(flux_dev_dir):
    pipe = omni_models.load(str(flux_dev_dir), max_sequence_length=16)
    _, eager = _generate(pipe, true_cfg_scale=1.0)
    pipe.compile_transformer(backend="eager")  # dynamo only: the graph capture, without a C++ toolchain
    _, compiled = _generate(pipe, true_cfg_scale=1.0)
    assert [i.tobytes() for i in compiled] == [i.tobytes() for i in eager]
