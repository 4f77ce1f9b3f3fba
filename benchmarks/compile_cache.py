"""Whether torch's caching precompile (``TORCH_CACHING_PRECOMPILE=1``) carries compiled functions across a
restart on this torch, for two cases, each compiled with inductor as served (symbolic shapes), each process fresh
over one cache directory per case:

- ``blocks``: three plain blocks (LayerNorm, Linear, scale), one row then three rows of another length;
- ``flux``: the tiny random FLUX.1-dev family through ``omni_models.load(compile=True)`` and the engine's warm-up
  (one row per forward, as FLUX.1-dev serves at 1024²). Needs diffusers and omni_server.

Per case: the first process (compiles, then ``save_compile_cache`` as the engine does after its warm-up), a
restart with the precompiled functions, and a restart without precompile (inductor's caches only, the default):
seconds from process start to exit, graphs compiled, functions loaded, or the error a process ended with.

    python benchmarks/compile_cache.py [--cases blocks flux] [--out DIR]

``--child CASE CACHE`` is one such process (``tests/omni_models/test_compiled_serving.py`` runs ``blocks``): it
prints one JSON line, with the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# This folder's fp8_cache.py would shadow the fp8_cache package (omni_models imports it).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class Block(torch.nn.Module):
    """A DiT block's shape of work. At module level: dynamo cannot save a guard on the type of a class defined in
    a function (torch raises a TypeError while compiling, it does not skip the package)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x)) * (1 + scale) + x


def child_blocks(cache: str) -> dict:
    from omni_models.compilation import (
        CompileSettings,
        compile_count,
        compile_modules,
        precompiled_count,
        save_compile_cache,
        use_compile_cache,
    )

    use_compile_cache(cache)
    torch.manual_seed(0)
    blocks = [Block() for _ in range(3)]
    compile_modules(blocks, CompileSettings())  # inductor, symbolic shapes, as served
    outputs = []
    with torch.no_grad():
        for rows, tokens in ((1, 16), (3, 24)):  # one row, then several rows of another length
            x = torch.randn(rows, tokens, 32)
            for block in blocks:
                x = block(x, torch.tensor(0.5))
            outputs.append(x.flatten().tolist())
    compiled = compile_count()
    return {"compiled": compiled, "loaded": precompiled_count(), "saved": save_compile_cache(), "outputs": outputs}


def child_flux(cache: str) -> dict:
    import omni_models
    from omni_models.compilation import compile_count, precompiled_count
    from omni_server.config import build_config
    from omni_server.engine import EngineCore

    checkpoint = Path(cache).parent / "flux"
    # 16 image tokens a forward: one row each, as FLUX.1-dev's 1024² images run (--max-batched-image-tokens 4096).
    pipeline = omni_models.load(str(checkpoint), compile=True, compile_cache_dir=cache, max_batched_image_tokens=16)
    EngineCore(pipeline, build_config(None, model="unused", device="cpu"))  # its warm-up saves the cache
    return {"compiled": compile_count(), "loaded": precompiled_count()}


def child(case: str, cache: str) -> None:
    try:
        result = {"blocks": child_blocks, "flux": child_flux}[case](cache)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}"[:300]}
    print(json.dumps(result))


def run_child(case: str, cache: Path, precompile: bool) -> tuple[float, dict]:
    root = Path(__file__).resolve().parents[1]
    sources = [str(p) for p in sorted((root / "packages").glob("*/src"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sources, os.environ.get("PYTHONPATH", "")])}
    env["TORCH_CACHING_PRECOMPILE"] = "1" if precompile else "0"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--child", case, str(cache)], env=env, capture_output=True, text=True, timeout=900
    )
    elapsed = time.monotonic() - start
    if done.returncode != 0:
        return elapsed, {"error": done.stderr.strip().splitlines()[-1][:300]}
    return elapsed, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "CACHE"), help="one process (prints one JSON line)")
    parser.add_argument("--cases", nargs="+", choices=("blocks", "flux"), default=["blocks", "flux"])
    parser.add_argument("--out", type=Path, help="write compile_cache.json here")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    report: dict = {"torch": torch.__version__, "cases": {}}
    for case in args.cases:
        work = Path(tempfile.mkdtemp(prefix=f"compile-cache-{case}-"))
        try:
            if case == "flux":
                from omni_models import synthetic

                synthetic.save_checkpoint("flux", synthetic.flux_components("tiny"), work / "flux")
            rows = report["cases"][case] = {}
            for label, precompile in (
                ("first process", True),
                ("restart with the precompiled functions", True),
                ("restart, inductor's caches only", False),
            ):
                elapsed, result = run_child(case, work / "compile", precompile)
                result.pop("outputs", None)
                rows[label] = {"seconds": elapsed, **result}
                said = result.get("error") or f"{result['compiled']} graphs compiled, {result['loaded']} loaded"
                print(f"torch {torch.__version__} {case}, {label}: {elapsed:.1f} s, {said}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_cache.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
