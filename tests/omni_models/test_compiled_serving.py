"""Compiled serving (omni_models.compilation) and the prompt-embedding cache, on the tiny random families.

Compiled with dynamo's ``"eager"`` backend: dynamo traces, guards and counts graphs exactly as it does for
inductor, without inductor's code generation (minutes on this CPU); the GPU run compiles with inductor
(benchmarks/serving.py, benchmarks/fast_paths.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from omni_models import GenerationRequest, resolve_request
from omni_models.prompt_cache import PromptEmbeddingCache

pytest.importorskip("diffusers")


def _run(pipe, requests: list[tuple[str, int, int]], steps: int = 2) -> list:
    """(prompt, side, n) requests denoised together (one forward per step for all of them)."""
    jobs = [
        job
        for prompt, side, n in requests
        for job in pipe.prepare(
            resolve_request(
                pipe.info,
                GenerationRequest(prompt=prompt, height=side, width=side, n=n, num_inference_steps=steps, seed=3),
            )
        )
    ]
    pipe.start(jobs)
    while not all(job.finished for job in jobs):
        pipe.step([job for job in jobs if not job.finished])
    images = pipe.decode(jobs)
    pipe.release(jobs)
    return images


def test_prompt_cache_is_an_lru_keyed_by_text_and_settings() -> None:
    encoded = []

    def encode(text: str) -> str:
        encoded.append(text)
        return text.upper()

    cache = PromptEmbeddingCache(2)
    assert cache.get_or_encode("a", "s", encode) == "A"
    assert cache.get_or_encode("a", "s", encode) == "A"  # a hit
    assert cache.get_or_encode("a", "other settings", encode) == "A"  # another key
    assert cache.get_or_encode("b", "s", encode) == "B"  # evicts ("a", "s"), the least recently used
    assert cache.get_or_encode("a", "other settings", encode) == "A"
    assert cache.get_or_encode("a", "s", encode) == "A"
    assert encoded == ["a", "a", "b", "a"] and (cache.hits, cache.misses, len(cache)) == (2, 4, 2)
    none = PromptEmbeddingCache(0)
    none.get_or_encode("a", "s", encode)
    none.get_or_encode("a", "s", encode)
    assert len(none) == 0 and encoded[-2:] == ["a", "a"]
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        PromptEmbeddingCache(-1)


def test_a_cached_prompt_skips_the_text_encoders_and_gives_the_same_image(flux_dev_dir, monkeypatch) -> None:
    import omni_models

    cached = omni_models.load(str(flux_dev_dir), prompt_embed_cache_size=4)
    plain = omni_models.load(str(flux_dev_dir))
    calls: list[str] = []
    encode = cached.backend.encode
    monkeypatch.setattr(cached.backend, "encode", lambda text: calls.append(text) or encode(text))
    first = _run(cached, [("a red fox", 32, 1)])
    again = _run(cached, [("a red fox", 32, 1), ("a blue square", 32, 1)])
    assert calls == ["a red fox", "a blue square"]  # the repeated prompt was not encoded again
    reference = _run(plain, [("a red fox", 32, 1)])
    assert np.array_equal(np.asarray(first[0]), np.asarray(reference[0]))
    assert np.array_equal(np.asarray(again[0]), np.asarray(reference[0]))


def test_compiled_flux_serves_every_size_and_batch_after_warm_up_without_recompiling(flux_dev_dir) -> None:
    import omni_models
    from omni_models.compilation import compile_count

    eager = omni_models.load(str(flux_dev_dir))
    compiled = omni_models.load(str(flux_dev_dir), compile=True, compile_backend="eager")
    assert compiled.compiled is not None
    # The engine's warm-up shapes: one row and two rows at a served size.
    _run(compiled, [("a red fox", 32, 1)], steps=1)
    _run(compiled, [("a red fox", 32, 2)], steps=1)
    ready = compile_count()
    assert ready > 0
    mixed = [("a dog in the snow at night", 48, 3), ("a cat", 64, 1)]
    images = _run(compiled, mixed, steps=1)
    images += _run(compiled, [("red", 16, 4)], steps=1)
    assert compile_count() == ready  # other sizes, other row counts: nothing compiled again
    reference = _run(eager, mixed, steps=1) + _run(eager, [("red", 16, 4)], steps=1)
    for image, expected in zip(images, reference, strict=True):
        assert np.array_equal(np.asarray(image), np.asarray(expected))


def test_the_blocks_of_a_class_share_one_graph() -> None:
    """Issue 24: on the shipped omni-flux-shapes-tiny (2 double-stream and 4 single-stream blocks), the first
    double-stream block (its inputs are views of the embedders' outputs) and the single-stream blocks after the
    first (slices of the previous block's joint output) compiled a graph of their own: 5 graphs for one row where
    the classes need 3."""
    from pathlib import Path

    import torch._dynamo

    import omni_models
    from omni_models.compilation import compile_count

    shipped = Path(omni_models.__file__).parent / "weights" / "omni-flux-shapes-tiny"
    torch._dynamo.reset()
    try:
        pipe = omni_models.load(str(shipped), compile=True, compile_backend="eager")
        start = compile_count()
        _run(pipe, [("a red circle", 32, 1)], steps=1)
        assert compile_count() - start == 3  # the double-stream block, the single-stream block, the VAE decoder
        # With several rows the single-stream blocks after the first still take a graph of their own (their
        # slices are strided there, which only a copy would hide): 4 more graphs, not 5 (RESULTS.md, 2026-12-02c).
    finally:
        torch._dynamo.reset()


def test_a_block_given_a_plain_tensor_over_a_longer_buffer_reuses_its_graph() -> None:
    """Issue 24 (cold start): inductor returns the slices of FLUX.1's joint output as plain tensors over the joint
    buffer (its ``reinterpret_tensor``: no view, so no ``_base``), whose stride along a batch of one row is the
    whole joint length's. The pre-hook handed them on as they were, and the single-stream blocks after the first
    compiled a second graph on every start (4 graphs at 1024² on the H200 where dynamo's eager backend, whose slices
    are views, counts 3; inductor on this CPU counted 4, now 3). Such a tensor, built here with ``set_`` over a
    longer buffer, must run the graph a contiguous input compiled."""
    import torch

    from omni_models.compilation import CompileSettings, compile_count, compile_modules

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compile_modules([block], CompileSettings(backend="eager"))
    with torch.no_grad():
        expected = block(torch.randn(1, 5, 8))  # compiles the one-row graph
        before = compile_count()
        joint = torch.randn(1, 12, 8)
        image = torch.empty(0).set_(joint.untyped_storage(), 4 * 8, (1, 7, 8), (12 * 8, 8, 1))  # rows 4.. of 12
        assert image._base is None and image.is_contiguous() and image.stride()[0] == 12 * 8
        out = block(image)
        assert compile_count() == before  # the same graph (it compiled another before the pre-hook's fix)
        assert torch.equal(out, block[1](block[0](joint[:, 4:11]))) and expected.shape == (1, 5, 8)


def test_compiled_qwen_image_batches_prompts_of_different_lengths_without_recompiling(qwen_image_dir) -> None:
    import omni_models
    from omni_models.compilation import compile_count

    compiled = omni_models.load(str(qwen_image_dir), compile=True, compile_backend="eager")
    _run(compiled, [("a red fox", 16, 1)], steps=1)
    _run(compiled, [("a red fox", 16, 2)], steps=1)
    ready = compile_count()
    # Ragged text rows (different prompt lengths), other counts and sizes: the lengths never enter a graph.
    _run(compiled, [("a cat", 16, 1), ("a blue square on the left of a red circle", 16, 2)], steps=1)
    _run(compiled, [("dog", 32, 1)], steps=1)
    assert compile_count() == ready


def test_compile_options_are_checked_before_loading(flux_dev_dir) -> None:
    import omni_models

    with pytest.raises(ValueError, match="compile cannot be combined with layerwise_offload"):
        omni_models.load(str(flux_dev_dir), compile=True, layerwise_offload=True)
    with pytest.raises(ValueError, match="compile_cache_dir keeps compiled graphs, so it needs compile=True"):
        omni_models.load(str(flux_dev_dir), compile_cache_dir="/tmp/x")
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        omni_models.load(str(flux_dev_dir), compile=True, compile_backend="tensorrt")
    with pytest.raises(ValueError, match="compile: a causal-prefix DiT compiles to CUDA graphs"):
        omni_models.load("omni-shapes-tiny", compile=True)


def test_restored_modules_run_their_own_forward_again() -> None:
    """``restore_modules`` undoes ``compile_modules`` (the video benchmark quantizes the blocks, then compiles them
    afresh): no compiled forward, no pre-hook, the same output, and nothing compiled by the next call."""
    import torch

    from omni_models.compilation import CompileSettings, compile_count, compile_modules, restore_modules

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(3, 8)
    expected = block(x)
    assert compile_modules([block], CompileSettings(backend="eager")) == 1
    assert torch.equal(block(x), expected) and "forward" in block.__dict__ and block._forward_pre_hooks
    assert restore_modules([block]) == 1
    assert "forward" not in block.__dict__ and not block._forward_pre_hooks
    before = compile_count()
    assert torch.equal(block(x), expected) and compile_count() == before
    assert restore_modules([block]) == 0  # a module not compiled is left as it is


def test_under_torchs_caching_precompile_a_restart_loads_the_compiled_blocks_and_traces_nothing(tmp_path) -> None:
    """Issue 24 (warm start): inductor's caches alone leave dynamo tracing every graph again at each start (24 s of
    FLUX.1-dev's warm start on the H200). With ``TORCH_CACHING_PRECOMPILE=1`` (torch's switch; off by default,
    RESULTS.md 2026-12-03f) the first process saves its compiled functions (``save_compile_cache``, the engine's
    call after warm-up) and a second process's ``torch.compile`` of the same blocks loads them and compiles no graph,
    for every shape the first one ran, with the same numbers. Without the switch nothing is saved and a restart
    traces again. Inductor for real (on this CPU, C++ kernels: most of this test's time is their first compile);
    the processes are ``benchmarks/compile_cache.py --child blocks``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_cache.py"
    cache = tmp_path / "compile"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(precompile: str) -> dict:
        command = [sys.executable, str(script), "--child", "blocks", str(cache)]
        more = {"TORCH_CACHING_PRECOMPILE": precompile}
        done = subprocess.run(command, env={**env, **more}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "is dropped with caching_precompile" not in done.stderr  # torch's notes kept out of the log
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert "error" not in result, result
        return result

    off = run("0")  # the default: inductor's caches only
    assert off["compiled"] == 2 and off["loaded"] == 0 and off["saved"] == 0  # one row, then symbolic rows
    assert not (cache / "dynamo").exists()
    first = run("1")
    assert first["compiled"] == 2 and first["loaded"] == 0 and first["saved"] == 1
    assert (cache / "dynamo").is_dir() and first["outputs"] == off["outputs"]
    second = run("1")
    assert second["compiled"] == 0 and second["loaded"] == 3 and second["saved"] == 0  # the three blocks' forwards
    assert second["outputs"] == first["outputs"]


def test_the_compile_cache_keeps_a_directory_per_model_and_load_options(tmp_path) -> None:
    """Guards on object identities cannot outlive a process, so a cache directory must only ever serve the model
    and options it was compiled for: ``load`` keys a subdirectory by the model's path and its load options."""
    from omni_models.compilation import compile_cache_scope

    model = tmp_path / "flux-dev"
    model.mkdir()
    fp8 = [("quantization", "fp8"), ("attention_dtype", "auto")]
    bf16 = [("quantization", None), ("attention_dtype", "auto")]
    assert compile_cache_scope(model, bf16) == compile_cache_scope(tmp_path / "." / "flux-dev", bf16)
    assert compile_cache_scope(model, bf16).startswith("flux-dev-")
    assert compile_cache_scope(model, fp8) != compile_cache_scope(model, bf16)
    other = tmp_path / "other" / "flux-dev"
    other.mkdir(parents=True)
    assert compile_cache_scope(other, bf16) != compile_cache_scope(model, bf16)
