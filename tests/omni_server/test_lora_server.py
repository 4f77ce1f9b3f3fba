"""LoRA through the product: vLLM's flags and routes on a real ``omni-server serve`` (tiny FLUX.1-dev, two PEFT
adapters), the engine core mixing adapters in one batched step, ``generate --lora``, and bad adapters at start.

Targets: 4 requests (adapters A, B, none, A at 0.5) in the same batched steps each give the image they give alone
(bitwise under ``--batch-invariant``, >= 40 dB otherwise); a bad adapter exits 2 at start naming the file, and is a
400 at runtime load with the server still serving.
"""

from __future__ import annotations

import base64
import io
import json
import threading

import msgspec
import pytest
from PIL import Image

from omni_server.cli import main

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

STEPS = 2
BODY = dict(size="32x32", num_inference_steps=STEPS, seed=5)


@pytest.fixture(scope="module")
def adapters(family_dirs, tmp_path_factory):
    from omni_models import synthetic

    tmp = tmp_path_factory.mktemp("adapters")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(str(family_dirs["flux"] / "transformer"))
    files = {}
    for name, rank, modules, seed in (
        ("a", 4, ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"], 1),
        ("b", 8, ["norm1.linear", "to_add_out", "proj_out"], 2),
        ("c", 4, ["ff.net.2", "add_v_proj"], 3),
        ("wide", 16, ["to_q"], 4),
    ):
        state, config = synthetic.random_lora(transformer, rank=rank, target_modules=modules, seed=seed, std=0.3)
        (tmp / name).mkdir()
        files[name] = synthetic.save_lora("flux", tmp / name, state, config)
    bad = tmp / "bad.safetensors"
    bad.write_bytes(files["a"].read_bytes()[: len(files["a"].read_bytes()) // 2])
    files["truncated"] = bad
    return files


@pytest.fixture(scope="module")
def server(family_dirs, adapters, server_factory):
    base = str(family_dirs["flux"])
    handle = server_factory(
        base,
        "--enable-lora",
        "--lora-modules",
        f"a={adapters['a']}",
        json.dumps({"name": "b", "path": str(adapters["b"].parent), "base_model_name": base}),
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--allow-runtime-lora-updating",
    )
    yield handle
    handle.stop()


def _image(response) -> Image.Image:
    assert response.status_code == 200, response.text
    return Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))


def _post_all(client, bodies):
    responses = [None] * len(bodies)

    def post(i):
        responses[i] = client.post("/v1/images/generations", json=bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return responses


MIXED = [
    dict(prompt="a red circle", model="a"),
    dict(prompt="a red circle", model="b"),
    dict(prompt="a red circle"),
    dict(prompt="a blue square", model="a", lora_scale=0.5),
]


def _mixed_requests() -> list:
    """``MIXED`` as the engine's requests (what the API builds from those bodies)."""
    from omni_models import GenerationRequest

    return [
        GenerationRequest(
            prompt=b["prompt"],
            lora=b.get("model"),
            lora_scale=b.get("lora_scale"),
            height=32,
            width=32,
            num_inference_steps=STEPS,
            seed=5,
        )
        for b in MIXED
    ]


def test_adapters_are_models_with_a_parent_and_requests_pick_them(server, family_dirs, adapters, tools) -> None:
    openai = pytest.importorskip("openai")
    base = str(family_dirs["flux"])
    with server.client(timeout=300) as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert list(models) == [base, "a", "b"]
        assert (models["a"]["parent"], models["a"]["root"]) == (base, str(adapters["a"]))
        assert models["b"]["parent"] == base and "parent" not in models[base]
        assert client.get("/v1/models/b").json()["root"] == str(adapters["b"].parent)
        together = [_image(r) for r in _post_all(client, [dict(body, **BODY) for body in MIXED])]
        alone = [_image(client.post("/v1/images/generations", json=dict(body, **BODY))) for body in MIXED]
        figures = [tools.psnr(x, y) for x, y in zip(together, alone, strict=True)]
        print(f"HTTP: A, B, none, A@0.5 concurrently vs alone: {figures} dB")
        assert min(figures) >= 40.0, figures
        assert tools.psnr(alone[0], alone[2]) < 30 and tools.psnr(alone[1], alone[2]) < 30
        # The official SDK selects an adapter by model and passes lora_scale as an extension field.
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        result = sdk.images.generate(
            model="a",
            prompt="a blue square",
            size="32x32",
            extra_body={"lora_scale": 0.5, "num_inference_steps": STEPS, "seed": 5},
        )
        assert tools.psnr(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), alone[3]) >= 40.0
        for body, status, param in (
            (dict(prompt="a cat", lora_scale=0.5), 400, "lora_scale"),  # a scale without an adapter
            (dict(prompt="a cat", model="a", lora_scale=11.0), 400, "lora_scale"),
            (dict(prompt="a cat", model="zzz"), 404, "model"),
        ):
            response = client.post("/v1/images/generations", json=dict(body, **BODY))
            assert (response.status_code, response.json()["error"]["param"]) == (status, param), response.text


def test_runtime_load_and_unload_and_a_bad_file_is_a_400(server, adapters, tools) -> None:
    with server.client(timeout=300) as client:
        plain = _image(client.post("/v1/images/generations", json=dict(prompt="a cat", **BODY)))
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'c' added successfully.")
        assert float(loaded.headers["x-lora-load-seconds"]) > 0
        with_c = _image(client.post("/v1/images/generations", json=dict(prompt="a cat", model="c", **BODY)))
        assert tools.psnr(with_c, plain) < 30
        for body, param, fragment in (
            ({"lora_name": "d", "lora_path": str(adapters["truncated"])}, "lora_path", str(adapters["truncated"])),
            ({"lora_name": "d", "lora_path": str(adapters["wide"])}, "lora_path", "max_lora_rank=8"),
            ({"lora_name": "c", "lora_path": str(adapters["a"])}, "lora_name", "unload it first"),
        ):
            response = client.post("/v1/load_lora_adapter", json=body)
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (400, param) and fragment in error["message"], error
        assert "d" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
        assert client.post("/v1/images/generations", json=dict(prompt="a cat", model="c", **BODY)).status_code == 404
        assert client.get("/health").status_code == 200
        again = _image(client.post("/v1/images/generations", json=dict(prompt="a cat", **BODY)))
        assert tools.psnr(again, plain) == float("inf")


def test_engine_mixes_adapters_in_each_step_bitwise_under_batch_invariant(family_dirs, adapters, tools) -> None:
    """The engine core in this process: all four requests are admitted in the first step and advance together."""
    from omni_models import resolve_request
    from omni_server.config import build_config
    from omni_server.engine import EngineCore, load_pipeline
    from omni_server.protocol import RequestFinished

    config = build_config(
        model=str(family_dirs["flux"]),
        device="cpu",
        warmup=False,
        enable_lora=True,
        lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"],
        max_lora_rank=8,
    )
    pipeline = load_pipeline(config, max_sequence_length=16)  # few prompt tokens: the test is about the rows
    # No runtime loading: LoRA applies to the linears the two adapters hold, no other (the server fixture, which
    # loads adapter c at run time, keeps every linear).
    assert set(pipeline.lora.targets) == pipeline.lora.registered_layers() < set(pipeline.lora.linears)
    resolved = [resolve_request(pipeline.info, r) for r in _mixed_requests()]

    def run(batch_invariant: bool, indices) -> dict[int, bytes]:
        engine = EngineCore(pipeline, msgspec.structs.replace(config, batch_invariant=batch_invariant))
        rows: list[int] = []
        hook = pipeline.transformer.register_forward_pre_hook(
            lambda _m, _a, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for i in indices:
            engine.add(str(i), resolved[i])
        out: dict[int, bytes] = {}
        while len(out) < len(indices):
            for message in engine.step():
                if isinstance(message, RequestFinished):
                    assert message.error is None, message.error
                    out[int(message.request_id)] = message.outputs[0]
        hook.remove()
        if len(indices) == 4:
            assert rows == ([1] * 4 if batch_invariant else [4]) * STEPS  # one step holds all four
        return out

    alone = [run(False, [i])[i] for i in range(4)]  # one request: one forward per step either way
    invariant, batched = run(True, range(4)), run(False, range(4))
    figures = [tools.psnr(*(Image.open(io.BytesIO(b)) for b in (batched[i], alone[i]))) for i in range(4)]
    equal = [invariant[i] == alone[i] for i in range(4)]
    print(f"engine: batch-invariant PNGs equal to alone: {equal}; batched vs alone {figures} dB")
    assert equal == [True] * 4
    assert min(figures) >= 40.0, figures


def test_a_compiled_engine_warms_the_lora_graphs_and_adapters_then_compile_nothing(family_dirs, adapters) -> None:
    """Compiled (dynamo's eager backend here; inductor on CUDA), a forward with an adapter runs other graphs than
    one without (those skip the LoRA ops). The warm-up runs every served shape both ways, so mixing adapters,
    scales and none afterwards compiles nothing (``recompiles_since_ready`` 0), and the images are the eager
    engine's."""
    import torch._dynamo

    import omni_models
    from omni_models import LoRAOptions, resolve_request
    from omni_server.config import build_config
    from omni_server.engine import EngineCore
    from omni_server.protocol import RequestFinished

    config = build_config(None, model="unused", device="cpu")

    def images(pipeline, engine) -> dict[str, bytes]:
        for index, request in enumerate(_mixed_requests()):
            engine.add(str(index), resolve_request(pipeline.info, request))
        out: dict[str, bytes] = {}
        while len(out) < len(MIXED):
            for message in engine.step():
                if isinstance(message, RequestFinished):
                    assert message.error is None, message.error
                    out[message.request_id] = message.outputs[0]
        return out

    def load(**options):
        pipeline = omni_models.load(str(family_dirs["flux"]), lora=LoRAOptions(max_loras=2, max_rank=8), **options)
        for name in ("a", "b"):
            pipeline.lora.register(name, adapters[name])
        return pipeline

    eager = load()
    expected = images(eager, EngineCore(eager, msgspec.structs.replace(config, warmup=False)))
    torch._dynamo.reset()
    try:
        compiled = load(compile=True, compile_backend="eager")
        engine = EngineCore(compiled, config)
        ready = engine.stats()
        assert ready.compiled_graphs > 0 and ready.recompiles_since_ready == 0
        assert images(compiled, engine) == expected
        assert engine.stats().recompiles_since_ready == 0
    finally:
        torch._dynamo.reset()


def test_generate_lora_path_scale_writes_what_the_server_draws(family_dirs, adapters, server, tmp_path) -> None:
    out = tmp_path / "x.png"
    argv = ["generate", "a blue square", "--model", str(family_dirs["flux"]), "--lora", f"{adapters['a']}:0.5"]
    argv += ["--steps", str(STEPS), "--size", "32x32", "--image-seed", "5", "-o", str(out), "--device", "cpu"]
    assert main(argv) == 0
    with server.client(timeout=300) as client:
        served = client.post("/v1/images/generations", json=dict(MIXED[3], **BODY))
    assert base64.b64decode(served.json()["data"][0]["b64_json"]) == out.read_bytes()


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--enable-lora", "--lora-modules", "w={wide}", "--max-lora-rank", "8"], "{wide}: has rank 16"),
        (["--enable-lora", "--lora-modules", "t={truncated}"], "{truncated}: cannot be read as a LoRA adapter"),
        (["--enable-lora", "--lora-modules", "q={qwen}"], "does not have as linears"),
        (["--lora-modules", "a={a}"], "--lora-modules configure LoRA serving; add --enable-lora"),
        (
            ["--enable-lora", "--lora-modules", "a={a}", "--lora-target-modules", "to_q", "to_k"],
            "{a}: holds layers for 6 linears outside --lora-target-modules",
        ),
        (["--lora-target-modules", "to_q"], "--lora-target-modules configure LoRA serving; add --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
    ],
)
def test_a_bad_adapter_exits_2_at_start_naming_the_file(family_dirs, adapters, tmp_path, capsys, flags, fragment):
    from omni_models import synthetic

    paths = {k: str(v) for k, v in adapters.items()}
    if any("{qwen}" in f for f in flags):
        transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(
            str(family_dirs["qwen-image"] / "transformer")
        )
        state, config = synthetic.random_lora(transformer, rank=4, target_modules=["img_mlp.net.2"])
        paths["qwen"] = str(synthetic.save_lora("qwen-image", tmp_path, state, config))
        capsys.readouterr()  # diffusers' loading bars
    flags = [f.format(**paths) for f in flags]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(family_dirs["flux"]), "--port", "1", "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-server: error: ") and fragment.format(**paths) in lines[0], (
        lines
    )
    if "--enable-lora" in flags and "=" in flags[2]:
        assert flags[2].split("=", 1)[0] in lines[0]  # the adapter's name, as --lora-modules gave it


def test_generate_with_a_bad_adapter_exits_2(family_dirs, adapters, tmp_path, capsys) -> None:
    argv = ["generate", "a cat", "--model", str(family_dirs["flux"]), "--lora", str(adapters["truncated"])]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "-o", str(tmp_path / "x.png"), "--device", "cpu"])
    assert exit_info.value.code == 2
    assert str(adapters["truncated"]) in capsys.readouterr().err and not (tmp_path / "x.png").exists()
