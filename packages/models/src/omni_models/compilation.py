"""Compiled serving: regional ``torch.compile`` of a pipeline's repeated blocks, a persistent compile cache, and a
count of every graph dynamo compiles.

``omni_models.load(..., compile=True)`` compiles the loaded pipeline:

- a diffusers family (``FamilyPipeline.compile``) compiles each block of its transformer's ``block_lists`` in
  place (one graph per block class, reused by every block of that class: diffusers' ``compile_repeated_blocks``
  recipe) and the modules its backend names in ``compiled_vae_modules`` (FLUX's VAE decoder);
- the causal-prefix DiT turns on its CUDA graphs (``omni_models.graphs``; its fused Triton ops are on already).

Shapes. Step batching changes a forward's row count and every request may ask for another size, so the graphs are
compiled with ``dynamic=True``: one graph covers every row count and sequence length (torch specializes a
dimension of size 1, so one row and several rows are two graphs), and steady serving never recompiles once those
have run. Marking the row count as an unbacked size instead gave one graph for every row count but, on the H200,
a 20% slower served FLUX.1 image and a slower compile (RESULTS.md, 2026-12-03d), so rows keep torch's rule.
``warmup_shapes`` lists the (rows, size) pairs an engine should run before it reports ready.
``compile_count`` counts every graph compiled in this process (dynamo's frame counter), so a server can show and
a test can assert that serving after warm-up compiled nothing.

Cache. ``use_compile_cache(directory)`` points inductor's FX graph and AOTAutograd caches (and Triton's kernel
cache) at ``directory`` before anything compiles, so a restart reuses what the last start compiled instead of
running inductor again. Dynamo still traces every graph again (24 s of FLUX.1-dev's 54.3 s warm start on the H200,
RESULTS.md 2026-12-03e). Torch's caching precompile, which would save that trace, stays off unless
``TORCH_CACHING_PRECOMPILE=1`` (torch's own switch) turns it on: a restart of the tiny FLUX.1 family failed under it
on torch 2.13 and 2.11 (RESULTS.md 2026-12-03f; ``benchmarks/compile_cache.py`` checks a torch). When it is on,
``save_compile_cache()`` (the server's call after its warm-up) writes each compiled function's guards and bytecode
and ``precompiled_count`` counts what a process loaded; torch then drops guards on object identities, so
``compile_cache_scope`` keys a directory per model and load options. ``compile_times`` says where a start's compile
time went.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class CompileSettings:
    """How ``compile_pipeline`` compiles: the dynamo backend (``"inductor"`` serves; ``"eager"`` and
    ``"aot_eager"`` trace without generating code, for tests) and whether shapes are symbolic from the start."""

    backend: str = "inductor"
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile backend must be one of {list(COMPILE_BACKENDS)}, got {self.backend!r}")

    def kwargs(self) -> dict[str, Any]:
        return {"backend": self.backend, "dynamic": self.dynamic}


def compile_cache_scope(model_dir: str | Path, options: Sequence[tuple[str, Any]]) -> str:
    """The subdirectory of a compile cache for one model loaded with one set of options: the model directory's
    name and a digest of its resolved path and of ``options`` (``(name, value)`` pairs whose ``repr`` is stable)."""
    resolved = Path(model_dir).expanduser().resolve()
    digest = hashlib.sha256(repr((str(resolved), tuple(options))).encode()).hexdigest()[:16]
    return f"{resolved.name}-{digest}"


class _DroppedGuardNote(logging.Filter):
    """Under caching precompile torch warns once per guard it drops (an object identity, which no other process
    shares); the scope of the cache directory stands for those guards, so the notes are kept out of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is dropped with caching_precompile" not in record.getMessage()


def use_compile_cache(directory: str | Path) -> Path:
    """Keep inductor's FX graph cache, AOTAutograd's cache and Triton's kernels under ``directory`` (created), and
    dynamo's precompiled functions when ``TORCH_CACHING_PRECOMPILE=1`` (``save_compile_cache`` writes them).

    Call before the first ``torch.compile`` of the process: inductor and Triton read these locations when they first
    write, and dynamo looks a function up in its cache when ``torch.compile`` wraps it.
    """
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    if dynamo_config.caching_precompile:  # TORCH_CACHING_PRECOMPILE=1, read by torch at import
        functorch_config.bundled_autograd_cache = True  # what precompile saves as the backend (implied from 2.13)
    guards_log = logging.getLogger("torch._dynamo.guards")
    if not any(isinstance(f, _DroppedGuardNote) for f in guards_log.filters):
        guards_log.addFilter(_DroppedGuardNote())
    logger.info("compile cache: %s", path)
    return path


def save_compile_cache() -> int:
    """Under caching precompile (``TORCH_CACHING_PRECOMPILE=1``), write what this process compiled to the compile
    cache: the backends' artifacts and dynamo's precompiled functions; returns how many functions were written (0
    when precompile is off)."""
    import torch

    if not torch._dynamo.config.caching_precompile:
        return 0
    saved = torch.compiler.save_cache_artifacts()
    return 0 if saved is None else len(saved[1].artifacts.get("precompile", ()))


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles alike)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def precompiled_count() -> int:
    """Functions this process loaded precompiled from the compile cache (each one's graphs traced by an earlier
    process; a loaded function whose guards fail still compiles, and ``compile_count`` counts that)."""
    from torch._dynamo.utils import counters

    return int(counters["dynamo_cache"]["dynamo_cache_hit"])


def compile_times(top: int = 6) -> list[tuple[str, float]]:
    """The ``top`` phases of this process's compiles by seconds spent (dynamo's own metrics; phases nest, so the
    figures overlap: tracing is ``bytecode_tracing``, inductor's code generation ``GraphLowering.codegen``)."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: sum(times) for name, times in compilation_time_metrics.items() if times}
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _plain(value: Any, tensor: type) -> Any:
    """``value`` as a compiled block receives it: a tensor laid out contiguously becomes a plain alias (not a view)
    with contiguous strides, without a copy; a tuple is done element by element; anything else (a strided tensor, a
    non-tensor) stays. Contiguous strides matter for tensors that are no view, too: inductor returns its outputs'
    slices as plain tensors over the joint buffer (``reinterpret_tensor``), whose stride along a batch of one row is
    the whole joint length's (FLUX.1's single-stream block compiled a second graph for them on every start).
    ``tensor``: ``torch.Tensor`` (the caller's import; torch stays unimported at this module's import)."""
    if type(value) is tuple:
        return tuple(_plain(item, tensor) for item in value)
    if not isinstance(value, tensor) or not value.is_contiguous():
        return value
    strides = _contiguous_strides(value.shape)
    if value.stride() != strides:  # differs only along size-1 dimensions (a slice of a batch of one row)
        return value.as_strided(value.shape, strides).detach()
    return value if value._base is None else value.detach()


def _plain_inputs(_module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """The forward pre-hook of a compiled module (it runs outside the compiled code): dynamo guards on how an input
    is laid out. It rebuilds a view from its base, and the guards check the base's strides. A contiguous input's
    strides along size-1 dimensions are checked too. Without this hook, the first double-stream block of FLUX.1
    (its inputs are views of the embedders' 2-D outputs) and the single-stream blocks after the first (slices of
    the previous block's joint output) each compile a second graph of their class. Under autograd the inputs
    stay as they are (``detach`` would cut the recorded graph)."""
    import torch

    if torch.is_grad_enabled():
        return None
    return tuple(_plain(a, torch.Tensor) for a in args), {k: _plain(v, torch.Tensor) for k, v in kwargs.items()}


def compile_modules(modules: Sequence[Any], settings: CompileSettings) -> int:
    """Compile each module's ``forward`` in place (the module object stays the same, so state dicts, attention
    processors and the hooks of its submodules keep working: they are traced into the graph, so install them
    first, dynamo does not guard on module hooks); returns how many.

    A forward pre-hook (``_plain_inputs``, run eagerly before the compiled forward) hands every block of a class
    inputs laid out alike, so that the blocks of one class share one graph per row-count class instead of
    compiling a second one for the block whose inputs are views (issue 24's "first block compiled twice").

    Duck shaping is turned off: otherwise two dimensions that happen to be equal at the first compile (a prompt of
    as many tokens as a static width, say) share one symbol, and the dynamic one is specialized to that value.
    """
    import torch
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    for module in modules:
        module.forward = torch.compile(module.forward, **settings.kwargs())
        module._omni_plain_inputs = module.register_forward_pre_hook(_plain_inputs, with_kwargs=True)
    return len(modules)


def restore_modules(modules: Sequence[Any]) -> int:
    """Undo ``compile_modules``: each module's own ``forward`` again, without the pre-hook; returns how many were
    compiled. For changing what the modules hold (quantizing their linears, say) and compiling them afresh."""
    restored = 0
    for module in modules:
        hook = module.__dict__.pop("_omni_plain_inputs", None)
        if hook is not None:
            hook.remove()
            del module.forward
            restored += 1
    return restored


def warmup_shapes(sizes: Sequence[tuple[int, int]], *, max_rows: int) -> list[tuple[int, tuple[int, int]]]:
    """The (rows, (height, width)) forwards that compile every graph serving can need at ``sizes``: one row and,
    when batches can hold more, two rows (the symbolic batch dimension) at each size."""
    rows = (1, 2) if max_rows >= 2 else (1,)
    return [(n, size) for size in dict.fromkeys(tuple(s) for s in sizes) for n in rows]


__all__ = [
    "COMPILE_BACKENDS",
    "CompileSettings",
    "compile_cache_scope",
    "compile_count",
    "compile_modules",
    "compile_times",
    "precompiled_count",
    "restore_modules",
    "save_compile_cache",
    "use_compile_cache",
    "warmup_shapes",
]
