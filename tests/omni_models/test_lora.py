"""LoRA per request (``omni_models.lora``, ``omni_models.lora_files``) on tiny random FLUX.1 and Qwen-Image
checkpoints, with adapters built by PEFT and written by diffusers' ``save_lora_weights``.

Targets: an adapter gives the image diffusers' ``load_lora_weights`` + ``set_adapters([name], [scale])`` gives
(PSNR >= 40 dB, fp32), in diffusers/PEFT and kohya layouts; rows of different adapters sharing one forward get
what they get alone; the Triton kernels equal the torch reference; a bad adapter is one ``LoRAError`` naming its
file and changes nothing.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import omni_models
from omni_models import GenerationRequest, LoRAError, LoRAOptions, resolve_request

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
from omni_models import synthetic  # noqa: E402 - needs diffusers
from omni_models.lora import LoRARows, LoRARuntime, lora_add, padded_rank  # noqa: E402

TARGET_DB = 40.0
COMMON = dict(num_inference_steps=2, height=32, width=32)
TEXT = dict(max_sequence_length=16)  # prompt tokens, omni and diffusers alike (the default 512 only costs time)
A_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "ff.net.2"]
B_MODULES = ["norm1.linear", "to_add_out", "ff_context.net.0.proj", "proj_out", "attn.to_k"]


def _write(tmp, family, transformer, name, **kwargs):
    state, config = synthetic.random_lora(transformer, **kwargs)
    directory = tmp / name
    directory.mkdir()
    return synthetic.save_lora(family, directory, state, config), state


@pytest.fixture(scope="module")
def flux_adapters(flux_dev_dir, tmp_path_factory):
    """Two FLUX adapters: A (rank 4, alpha 8) and B (rank 8, alpha 4), on different linears."""
    tmp = tmp_path_factory.mktemp("flux-lora")
    reference = diffusers.FluxTransformer2DModel.from_pretrained(str(flux_dev_dir / "transformer"))
    a, a_state = _write(tmp, "flux", reference, "a", rank=4, lora_alpha=8, target_modules=A_MODULES, seed=1, std=0.3)
    b, _ = _write(tmp, "flux", reference, "b", rank=8, lora_alpha=4, target_modules=B_MODULES, seed=2, std=0.3)
    return {"a": a, "b": b, "a_state": a_state, "tmp": tmp}


@pytest.fixture(scope="module")
def flux(flux_dev_dir, flux_adapters):
    pipe = omni_models.load(str(flux_dev_dir), lora=LoRAOptions(max_loras=2, max_rank=8), **TEXT)
    pipe.lora.register("a", flux_adapters["a"])
    pipe.lora.register("b", flux_adapters["b"])
    return pipe


@pytest.fixture(scope="module")
def flux_reference(flux_dev_dir):
    return diffusers.FluxPipeline.from_pretrained(str(flux_dev_dir), dtype=torch.float32)


def _reference_image(reference, path, scale, prompt, seed, text=TEXT, **kwargs):
    reference.load_lora_weights(str(path), adapter_name="under_test")
    try:
        reference.set_adapters(["under_test"], [scale])
        generator = torch.Generator("cpu").manual_seed(seed)
        return reference(prompt, generator=generator, **text, **kwargs).images[0]
    finally:
        reference.delete_adapters(["under_test"])


def test_kernels_match_the_reference_and_leave_rows_without_an_adapter_untouched():
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        rank = padded_rank(5)
        x = torch.randn(4, 7, 40, generator=generator).to(dtype)
        down = (torch.randn(3, rank, 40, generator=generator) * 0.2).to(dtype)
        up = (torch.randn(3, 24, rank, generator=generator) * 0.2).to(dtype)
        scaling = torch.tensor([0.5, 2.0, 1.0])
        y = torch.randn(4, 7, 24, generator=generator).to(dtype)
        rows = LoRARows(torch.tensor([2, -1, 0, 2], dtype=torch.int32), torch.tensor([1.0, 1.0, 0.5, -1.5]))
        reference = lora_add(y.clone(), x, down, up, scaling, rows, triton=False)
        kernel = lora_add(y.clone(), x, down, up, scaling, rows, triton=True)
        assert (kernel.float() - reference.float()).abs().max() <= tolerance * reference.float().abs().max()
        assert torch.equal(kernel[1], y[1]) and torch.equal(reference[1], y[1])
        assert not torch.equal(kernel[0], y[0])
    # Under torch.compile the kernels are one opaque op: one whole graph, and new row tables never recompile it.
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda y, rows: lora_add(y, x, down, up, scaling, rows, triton=True), backend="aot_eager", fullgraph=True
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for slots in ([0, 1, 2, -1], [-1, -1, -1, -1], [2, 2, 2, 2]):
            rows = LoRARows(torch.tensor(slots, dtype=torch.int32), torch.ones(4))
            expected = lora_add(y.clone(), x, down, up, scaling, rows, triton=False)
            assert (compiled(y.clone(), rows).float() - expected.float()).abs().max() <= tolerance * 10
    torch._dynamo.reset()


def test_flux_adapter_matches_diffusers_load_lora_weights(flux, flux_reference, flux_adapters, psnr):
    assert set(flux.lora.targets) >= {"transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_out"}
    prompt = "a red circle at the top left"
    base = flux(prompt, seed=3, **COMMON)[0]
    for name, scale in (("a", 0.7), ("b", 1.0)):
        image = flux(prompt, seed=3, lora=name, lora_scale=scale if name == "a" else None, **COMMON)[0]
        expected = _reference_image(flux_reference, flux_adapters[name], scale, prompt, 3, **COMMON)
        figure, effect = psnr(image, expected), psnr(image, base)
        print(f"FLUX adapter {name} at {scale}: {figure:.1f} dB vs diffusers, {effect:.1f} dB vs no adapter")
        assert figure >= TARGET_DB, name
        assert effect < 30.0, f"adapter {name} changes the image"
    # The Triton kernels (interpreted here: one step) give the torch reference's image.
    one_step = dict(COMMON, num_inference_steps=1)
    flux.lora.backend = "triton"
    try:
        kernel_image = flux(prompt, seed=3, lora="a", lora_scale=0.7, **one_step)[0]
    finally:
        flux.lora.backend = "auto"
    assert psnr(kernel_image, flux(prompt, seed=3, lora="a", lora_scale=0.7, **one_step)[0]) >= TARGET_DB


def test_kohya_layout_goes_through_diffusers_converter(flux, flux_reference, flux_adapters, psnr):
    from safetensors.torch import save_file

    rank, generator = 4, torch.Generator().manual_seed(7)
    width = flux.transformer.config.num_attention_heads * flux.transformer.config.attention_head_dim

    def pair(out_features: int, in_features: int = width) -> dict[str, torch.Tensor]:
        return {
            "lora_down.weight": torch.randn(rank, in_features, generator=generator) * 0.3,
            "lora_up.weight": torch.randn(out_features, rank, generator=generator) * 0.3,
            "alpha": torch.tensor(2.0 * rank),
        }

    layers = {
        "lora_unet_double_blocks_0_img_attn_qkv": pair(3 * width),  # split into to_q/to_k/to_v by the converter
        "lora_unet_double_blocks_0_img_attn_proj": pair(width),
        "lora_unet_single_blocks_1_linear2": pair(
            width, flux.transformer.single_transformer_blocks[1].proj_out.in_features
        ),
    }
    directory = flux_adapters["tmp"] / "kohya"
    directory.mkdir()
    file = directory / "style.safetensors"
    save_file({f"{k}.{part}": v.contiguous() for k, d in layers.items() for part, v in d.items()}, str(file))
    flux.lora.register("kohya", directory)
    try:
        image = flux("a blue square", seed=5, lora="kohya", **COMMON)[0]
    finally:
        flux.lora.unregister("kohya")
    expected = _reference_image(flux_reference, file, 1.0, "a blue square", 5, **COMMON)
    print(f"kohya FLUX adapter: {psnr(image, expected):.1f} dB vs diffusers")
    assert psnr(image, expected) >= TARGET_DB
    assert psnr(image, flux("a blue square", seed=5, **COMMON)[0]) < 30.0


def test_qwen_image_adapter_matches_diffusers_under_true_cfg(qwen_image_dir, tmp_path, psnr):
    components = diffusers.QwenImagePipeline.from_pretrained(str(qwen_image_dir), dtype=torch.float32)
    file, _ = _write(
        tmp_path,
        "qwen-image",
        components.transformer,
        "q",
        rank=4,
        target_modules=["to_q", "to_v", "add_k_proj", "to_out.0", "img_mlp.net.2", "txt_mod.1"],
        seed=3,
        std=0.3,
    )
    pipe = omni_models.load(str(qwen_image_dir), lora=LoRAOptions(max_loras=1, max_rank=4), **TEXT)
    pipe.lora.register("q", file)
    kwargs = dict(negative_prompt="blurry", true_cfg_scale=4.0, **COMMON)
    image = pipe("a red circle", seed=9, lora="q", lora_scale=1.3, **kwargs)[0]
    expected = _reference_image(components, file, 1.3, "a red circle", 9, **kwargs)
    print(f"Qwen-Image adapter at 1.3, true CFG: {psnr(image, expected):.1f} dB vs diffusers")
    assert psnr(image, expected) >= TARGET_DB
    assert psnr(image, pipe("a red circle", seed=9, **kwargs)[0]) < 30.0


def _alone(pipe, **request):
    (job,) = pipe.prepare(resolve_request(pipe.info, GenerationRequest(**request)))
    pipe.start([job])
    while not job.finished:
        pipe.step([job])
    return pipe.decode([job])[0]


def test_four_requests_with_different_adapters_share_each_forward_without_bleeding(flux, psnr):
    requests = [
        dict(prompt="a red circle", lora="a", seed=1),
        dict(prompt="a red circle", lora="b", seed=1),
        dict(prompt="a red circle", seed=1),
        dict(prompt="a green triangle", lora="a", lora_scale=0.5, seed=2, negative_prompt="blurry", true_cfg_scale=2.0),
    ]
    requests = [dict(r, **COMMON) for r in requests]
    alone = [_alone(flux, **r) for r in requests]
    jobs = [job for r in requests for job in flux.prepare(resolve_request(flux.info, GenerationRequest(**r)))]
    forwards: list[int] = []
    hook = flux.transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: forwards.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        flux.start(jobs)
        while not jobs[0].finished:
            flux.step(jobs)
    finally:
        hook.remove()
    assert forwards == [5] * COMMON["num_inference_steps"]  # all 5 rows (one guided) in one forward per step
    figures = [psnr(together, single) for together, single in zip(flux.decode(jobs), alone, strict=True)]
    print(f"A, B, none, A@0.5 in one forward vs alone: {[round(f, 1) for f in figures]} dB")
    assert min(figures) >= TARGET_DB
    assert psnr(alone[0], alone[2]) < 30.0 and psnr(alone[1], alone[2]) < 30.0


def test_more_adapters_than_slots_split_the_forward_and_reload_from_disk(flux_dev_dir, flux_adapters, flux, psnr):
    pipe = omni_models.load(str(flux_dev_dir), lora=LoRAOptions(max_loras=1, max_cpu_loras=1, max_rank=8), **TEXT)
    for name in ("a", "b"):
        pipe.lora.register(name, flux_adapters[name])
    assert pipe.lora.host_resident() == ["b"]  # the host LRU holds one; "a" is read again when used
    requests = [dict(prompt="a red circle", lora=name, seed=4, **COMMON) for name in ("a", "b")]
    jobs = [job for r in requests for job in pipe.prepare(resolve_request(pipe.info, GenerationRequest(**r)))]
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    stats = pipe.lora.stats
    assert stats.forwards_split == COMMON["num_inference_steps"] and stats.file_reads >= 1
    for image, r in zip(pipe.decode(jobs), requests, strict=True):
        assert psnr(image, _alone(flux, **r)) >= TARGET_DB


def test_offloaded_and_fp8_bases_serve_adapters_with_their_weights_untouched(flux_dev_dir, flux_adapters, flux, psnr):
    from fp8_cache import FP8Linear

    request = dict(prompt="a red circle", seed=6, lora="a", **COMMON)
    expected = flux(**request)[0]
    offloaded = omni_models.load(str(flux_dev_dir), layerwise_offload=True, lora=LoRAOptions(max_rank=8), **TEXT)
    offloaded.lora.register("a", flux_adapters["a"])
    assert psnr(offloaded(**request)[0], expected) == float("inf")  # offload is exact; so is the adapter on it
    fp8 = omni_models.load(str(flux_dev_dir), quantization="fp8", lora=LoRAOptions(max_rank=8), **TEXT)
    fp8.lora.register("a", flux_adapters["a"])
    quantized = {n: m.weight.clone() for n, m in fp8.transformer.named_modules() if isinstance(m, FP8Linear)}
    assert quantized and set(quantized) <= set(fp8.lora.targets)
    assert psnr(fp8(**request)[0], fp8(**{**request, "lora": None})[0]) < 30.0
    assert all(torch.equal(fp8.transformer.get_submodule(n).weight, w) for n, w in quantized.items())


def test_an_fp8_linear_keeps_its_weights_and_gets_the_delta():
    from fp8_cache import FP8Linear
    from omni_models.lora import LoRALayer, LoRAWeights

    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear.from_linear(nn.Linear(32, 48)))
    down, up = torch.randn(4, 32) * 0.1, torch.randn(48, 4) * 0.1
    weights = LoRAWeights({"0": LoRALayer(down, up, scaling=2.0)})
    options = LoRAOptions(max_loras=1, max_rank=4)
    runtime = LoRARuntime(model, lambda _path: weights, options, device=torch.device("cpu"), dtype=torch.float32)
    adapter = runtime.register("x", "unused.safetensors")
    x = torch.randn(2, 5, 32)
    base = model(x)
    weight = model[0].weight.clone()
    with runtime.rows([adapter, None], [0.5, 1.0]):
        out = model(x)
    assert torch.allclose(out[0], base[0] + 0.5 * 2.0 * (x[0] @ down.T) @ up.T, atol=1e-5)
    assert torch.equal(out[1], base[1]) and torch.equal(model[0].weight, weight)


class _Projections(nn.Module):
    """An attention's Q/K/V as diffusers names them, with K optionally on another input (cross-attention)."""

    def __init__(self, k_width: int) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(32, 24), nn.Linear(32, k_width), nn.Linear(32, 24)

    def forward(self, x, other=None):
        return torch.cat([self.to_q(x), self.to_k(x if other is None else other), self.to_v(x)], dim=-1)


@pytest.mark.parametrize("k_width, expands", [(16, 3), (24, 1)])
def test_linears_sharing_an_input_shrink_it_once_and_each_add_their_own_delta(flux, k_width, expands):
    """The row path's shared shrink: Q/K/V (and FLUX's single-stream MLP beside them) shrink their one input in one
    ``bmm``, and members of equal output width expand in one ``bmm`` too (Q/K/V of equal widths: 1; Q 24, K 16, V
    24: 3). A member called on another tensor shrinks and expands that anew, so the output stays each linear's own
    delta."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omni_models.lora import LoRALayer, LoRAWeights

    class CountBmm(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func is torch.ops.aten.bmm.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = _Projections(k_width)
    layers = {
        name: LoRALayer(torch.randn(3, 32) * 0.2, torch.randn(linear.out_features, 3) * 0.2, scaling=2.0)
        for name, linear in model.named_children()
    }
    options = LoRAOptions(max_loras=2, max_rank=4)
    runtime = LoRARuntime(
        model, lambda _path: LoRAWeights(layers), options, device=torch.device("cpu"), dtype=torch.float32
    )
    assert [group.names for group in runtime.groups] == [("to_q", "to_k", "to_v")]
    adapter = runtime.register("x", "unused.safetensors")
    x, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    for k_input, bmm_calls in ((None, 1 + expands), (other, 3 + 3)):  # K elsewhere: every member's own
        base = model(x, k_input)
        counter = CountBmm()
        with runtime.rows([adapter, None], [0.5, 1.0]), counter:
            out = model(x, k_input)
        assert counter.calls == bmm_calls
        inputs = {"to_q": x, "to_k": x if k_input is None else k_input, "to_v": x}
        deltas = [0.5 * 2.0 * (inputs[n][0] @ layer.down.T) @ layer.up.T for n, layer in layers.items()]
        assert torch.allclose(out[0], base[0] + torch.cat(deltas, dim=-1), atol=1e-5)
        assert torch.equal(out[1], base[1])
        assert all(group.input is None for group in runtime.groups)
    # The FLUX transformer: Q/K/V and the text stream's in every double-stream block, MLP + Q/K/V in every single.
    transformer = flux.transformer
    expected = 2 * len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    assert len(flux.lora.groups) == expected
    assert ("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v") in {
        tuple(name.split(".", 2)[2] for name in group.names) for group in flux.lora.groups
    }


def test_restricted_targets_draw_the_same_images_and_refuse_adapters_outside(flux_dev_dir, flux_adapters, flux, psnr):
    """``restrict`` to the linears adapter A holds (what omni-server does for a fixed set of adapters): every other
    linear loses its hook, so it launches nothing; A's image is the unrestricted pipeline's; an adapter with layers
    elsewhere is one error naming its file, and changes nothing. ``select_targets`` matches as PEFT's
    ``target_modules`` list does."""
    from omni_models.lora import select_targets

    pipe = omni_models.load(str(flux_dev_dir), lora=LoRAOptions(max_loras=2, max_rank=8), **TEXT)
    lora = pipe.lora
    assert set(lora.targets) == set(lora.linears)
    lora.register("a", flux_adapters["a"])
    lora.restrict(sorted(lora.registered_layers()))
    assert set(lora.targets) == lora.registered_layers() and len(lora.targets) < len(lora.linears)
    for name in lora.linears:
        hooked = bool(pipe.transformer.get_submodule(name)._forward_hooks)
        assert hooked == (name in lora.targets), name
    image = pipe("a red circle", seed=3, lora="a", **COMMON)[0]
    assert psnr(image, flux("a red circle", seed=3, lora="a", **COMMON)[0]) >= 60.0
    with pytest.raises(LoRAError, match=f"^{re.escape(str(flux_adapters['b']))}: .*this server does not apply LoRA to"):
        lora.register("b", flux_adapters["b"])
    assert lora.get("b") is None and [a.name for a in lora.adapters()] == ["a"]
    with pytest.raises(ValueError, match="adapter 'a' has layers outside the targets"):
        lora.restrict(["transformer_blocks.0.attn.to_q"])
    names = ["x.to_q", "x.to_k", "y.attn.to_q", "to_q_extra"]
    assert select_targets(names, ["to_q"]) == ["x.to_q", "y.attn.to_q"]
    assert select_targets(names, ["all-linear"]) == names
    with pytest.raises(ValueError, match="'nope' names no linear"):
        select_targets(names, ["to_q", "nope"])


def test_a_compiled_pipeline_applies_its_adapters(flux_dev_dir, flux_adapters, flux):
    """Dynamo does not guard on module hooks: a compiled block runs the hooks it traced, and a hook added after its
    first compiled call never runs (the 2026-12-02c H200 benchmark measured exactly that). ``omni_models.load``
    installs the LoRA hooks before it compiles, so the compiled pipeline's images are the eager ones, adapter and
    none alike, also when the first forward carries no adapter."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        compiled = omni_models.load(
            str(flux_dev_dir), lora=LoRAOptions(max_loras=2, max_rank=8), compile=True, compile_backend="eager", **TEXT
        )
        compiled.lora.register("a", flux_adapters["a"])
        request = dict(prompt="a red circle", seed=1, **COMMON)
        plain = _alone(compiled, **request)
        with_a = _alone(compiled, lora="a", **request)
        assert np.array_equal(np.asarray(plain), np.asarray(_alone(flux, **request)))
        assert np.array_equal(np.asarray(with_a), np.asarray(_alone(flux, lora="a", **request)))
        assert not np.array_equal(np.asarray(with_a), np.asarray(plain))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled_path", ["torch", "reference", "kernels"])
def test_switching_and_mixing_adapters_never_recompiles(flux, compiled_path):
    """Every compiled path: the row path traced into the graph (the default), the per-linear reference, and the
    Triton kernels (interpreted here) as one opaque op. Every block of the class is compiled, as the server
    compiles them, and the LoRA path adds one graph for the class (under ``warming()``, as the engine warms up),
    not one per block. Then every row table, with adapters or none, runs the graphs compiled so far."""
    import torch._dynamo

    from omni_models.compilation import CompileSettings, compile_count, compile_modules, restore_modules

    if compiled_path == "kernels":
        pytest.importorskip("triton")
    torch._dynamo.reset()
    blocks = list(flux.transformer.single_transformer_blocks)
    assert len(blocks) >= 2
    compile_modules(blocks, CompileSettings(backend="eager"))
    flux.lora.backend = "triton" if compiled_path == "kernels" else "auto"
    flux.lora.compiled_path = compiled_path
    flux.lora.compiled = True

    def step(adapters):
        job_requests = [dict(prompt="a red circle", lora=name, seed=1, **COMMON) for name in adapters]
        jobs = [j for r in job_requests for j in flux.prepare(resolve_request(flux.info, GenerationRequest(**r)))]
        flux.start(jobs)
        flux.step(jobs)
        return [job.latents for job in jobs]

    try:
        plain = step([None, None])
        base_graphs = compile_count()
        with flux.lora.warming():  # the LoRA path with a zero delta: the base output exactly
            assert all(torch.equal(a, b) for a, b in zip(step([None, None]), plain, strict=True))
        assert compile_count() - base_graphs == 1
        with torch._dynamo.config.patch(error_on_recompile=True):
            for adapters in (["a", "b"], ["b", None], [None, None], ["a", "a"]):
                step(adapters)
    finally:
        flux.lora.backend = "auto"
        flux.lora.compiled_path = "torch"
        flux.lora.compiled = False
        restore_modules(blocks)
        torch._dynamo.reset()


def test_compiled_path_is_checked():
    runtime = LoRARuntime(
        torch.nn.Linear(4, 4), lambda path: None, LoRAOptions(), device=torch.device("cpu"), dtype=torch.float32
    )
    with pytest.raises(ValueError, match=r"compiled_path must be one of \['torch', 'kernels', 'reference'\]"):
        runtime.compiled_path = "triton"
    assert runtime.compiled_path == "torch"


def test_an_eager_forward_without_adapters_launches_no_kernel(flux, monkeypatch):
    """LoRA on, no row on an adapter, eager (``--enforce-eager``): the Triton path adds nothing and launches
    nothing (2026-12-02c measured the launches alone at 1.155x the base step on the H200); the image is the base
    one. One row on an adapter launches once per targeted linear. A compiled pipeline's linears outside its blocks
    run eagerly on the row copy its graphs read, never the kernels (their opaque op cost 0.23 ms of host time a
    call on the H200, at the forward's start, where the device waits): the image is the torch path's, exactly."""
    pytest.importorskip("triton")
    from omni_models import lora as lora_module

    kernels = lora_module._kernels()
    launches = []
    launch = kernels.lora_shrink_expand
    monkeypatch.setattr(kernels, "lora_shrink_expand", lambda *args: launches.append(1) or launch(*args))
    one_step = dict(COMMON, num_inference_steps=1)
    base = flux("a red circle", seed=3, **one_step)[0]
    flux.lora.backend = "triton"
    try:
        plain = flux("a red circle", seed=3, **one_step)[0]
        assert launches == [] and np.array_equal(np.asarray(plain), np.asarray(base))
        flux("a red circle", seed=3, lora="a", **one_step)
        assert len(launches) > 0
        launches.clear()
        flux.lora.compiled = True  # nothing compiles here: every linear runs as one outside the blocks would
        rows_path = flux("a red circle", seed=3, lora="a", **one_step)[0]
        assert launches == []
        flux.lora.backend = "torch"
        torch_path = flux("a red circle", seed=3, lora="a", **one_step)[0]
        assert np.array_equal(np.asarray(rows_path), np.asarray(torch_path))
    finally:
        flux.lora.backend = "auto"
        flux.lora.compiled = False


# --- bad adapters ----------------------------------------------------------------------------------------------


def test_bad_adapters_are_one_error_naming_the_file_and_change_nothing(
    flux, flux_dev_dir, flux_adapters, qwen_image_dir
):
    from safetensors.torch import load_file, save_file

    tmp = flux_adapters["tmp"] / "bad"
    tmp.mkdir()
    qwen_transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(str(qwen_image_dir / "transformer"))
    qwen_file, _ = _write(tmp, "qwen-image", qwen_transformer, "qwen", rank=4, target_modules=["img_mlp.net.2"])
    from omni_models.diffusers_adapter import parameters_on_meta

    with parameters_on_meta():
        wider = diffusers.FluxTransformer2DModel(
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            in_channels=16,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
            guidance_embeds=True,
        )
    wider_file, _ = _write(tmp, "flux", wider, "wider", rank=4, target_modules=["to_q"])
    big_rank, _ = _write(tmp, "flux", flux.transformer, "rank16", rank=16, target_modules=["to_q"])
    good = load_file(str(flux_adapters["a"]))
    corrupt = tmp / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(flux_adapters["a"].read_bytes()[:-100])
    text_encoder = tmp / "text_encoder.safetensors"
    save_file(
        {**good, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
        str(text_encoder),
    )
    two = tmp / "two"
    two.mkdir()
    for name in ("x", "y"):
        save_file(good, str(two / f"{name}.safetensors"))
    cases = {
        qwen_file: "does not have as linears",
        wider_file: "was made for another base model",
        big_rank: "above the largest rank",
        corrupt: "cannot be read as a LoRA adapter",
        truncated: "cannot be read as a LoRA adapter",
        text_encoder: "text encoder",
        two: "exactly one .safetensors file",
        tmp / "missing.safetensors": "no such LoRA file",
    }
    before = [a.name for a in flux.lora.adapters()], flux.lora.resident()
    for path, problem in cases.items():
        for check in (
            lambda p: flux.lora.register("bad", p),
            lambda p: omni_models.inspect_lora(str(flux_dev_dir), p, max_rank=8),
        ):
            with pytest.raises(LoRAError) as error:
                check(path)
            message = str(error.value)
            assert message.startswith(str(path)) and problem in message and "\n" not in message, message
    assert ([a.name for a in flux.lora.adapters()], flux.lora.resident()) == before


def test_requests_name_adapters_and_scales_by_the_rules(flux):
    info = flux.info
    with pytest.raises(omni_models.InvalidRequestError, match="lora_scale applies to a LoRA adapter") as error:
        resolve_request(info, GenerationRequest(prompt="a cat", lora_scale=0.5))
    assert error.value.param == "lora_scale"
    for scale in (float("nan"), 11.0, True):
        with pytest.raises(omni_models.InvalidRequestError) as error:
            resolve_request(info, GenerationRequest(prompt="a cat", lora="a", lora_scale=scale))
        assert error.value.param == "lora_scale"
    with pytest.raises(omni_models.InvalidRequestError, match="no LoRA adapter named 'zzz'") as error:
        flux.prepare(resolve_request(info, GenerationRequest(prompt="a cat", lora="zzz")))
    assert error.value.param == "model"
    dit = omni_models.inspect("omni-shapes-tiny").info  # a model that takes no adapters names the field sent
    for request, param in (({"lora": "a"}, "model"), ({"lora_scale": 0.5}, "lora_scale")):
        with pytest.raises(omni_models.InvalidRequestError) as error:
            resolve_request(dit, GenerationRequest(prompt="a red circle", **request))
        assert error.value.param == param
    (job,) = flux.prepare(resolve_request(info, GenerationRequest(prompt="a cat", lora="a", lora_scale=-1)))
    assert job.lora.name == "a" and job.request.lora_scale == -1.0
    flux.release([job])
    assert job.lora is None


# --- the shipped adapter -----------------------------------------------------------------------------------------


def test_shipped_colour_shift_adapter_matches_diffusers_and_shifts_only_its_own_rows(psnr):
    """``omni-flux-shapes-tiny/lora/colour-shift``: diffusers draws what omni draws with it, and in one batched
    forward the row asking for it is drawn one palette step on while its neighbour is not."""
    from omni_models.hub import resolve_model_dir
    from omni_models.training import flux_shapes as fs
    from omni_models.training.scorer import read_scenes
    from omni_models.training.shapes import split_scenes
    from omni_models.training.train_lora import ADAPTER_NAME, shows_shift

    directory = resolve_model_dir("omni-flux-shapes-tiny")
    adapter = directory / "lora" / ADAPTER_NAME
    pipe = omni_models.load("omni-flux-shapes-tiny", lora=LoRAOptions(max_loras=1, max_rank=16))
    pipe.lora.register(ADAPTER_NAME, adapter)
    scene = split_scenes()[1][0]  # held out of the base model's training and of the adapter's fit
    steps = dict(num_inference_steps=4, height=64, width=64)
    jobs = [
        job
        for lora in (ADAPTER_NAME, None)
        for job in pipe.prepare(
            resolve_request(pipe.info, GenerationRequest(prompt=scene.caption(), lora=lora, seed=10_000, **steps))
        )
    ]
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    shifted_image, neighbour = pipe.decode(jobs)
    with_adapter, without = read_scenes(fs.scorer_images([shifted_image, neighbour]))
    assert shows_shift(with_adapter, scene) and not shows_shift(without, scene), (with_adapter, without, scene)
    reference = diffusers.FluxPipeline.from_pretrained(str(directory), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    expected = _reference_image(reference, adapter, 1.0, scene.caption(), 10_000, text={}, **steps)
    print(f"shipped colour-shift adapter: {psnr(shifted_image, expected):.1f} dB vs diffusers; {with_adapter}")
    assert psnr(shifted_image, expected) >= TARGET_DB
