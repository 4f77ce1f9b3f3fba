"""The pieces of compiled serving, timed on their own (issue 24), each beside its same-run baseline:

    python benchmarks/fast_paths.py --out DIR            # H200
    python benchmarks/fast_paths.py --smoke --out DIR    # tiny, CPU (checks that every section runs)

- ``attention``: at FLUX.1 shapes (24 heads x 128; 1024^2: 4608 tokens, 256^2: 768) and Wan2.1-1.3B's
  (12 x 128, 832x480x81: 32,760 tokens), torch's default SDPA order against each backend alone, the families'
  attention (``omni_models.attention``) and omni's FP8 attention (``--attention-dtype fp8``), with the error of
  each;
- ``fp8_linear``: ``FP8Linear`` eager (rowwise, one fused Triton quantization kernel; per-tensor) vs bf16
  ``F.linear`` at FLUX.1's linear shapes, host time included (wall clock over back-to-back calls); and three
  linears reading one input (Q, K, V), which quantize it once;
- ``blocks``: a FLUX.1-width transformer with 2 double and 4 single blocks (random weights), one forward at 1024^2
  and 256^2: diffusers' processors eager, omni eager, omni FP8 eager, omni compiled (``FamilyPipeline.compile``
  settings: dynamic shapes) and omni FP8 compiled, with compile times and graphs compiled.
Every number lands in ``DIR/fast_paths.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device: torch.device, *, iters: int, warmup: int = 3, repeats: int = 5) -> dict[str, Any]:
    """Median and range over ``repeats`` of the mean wall time of ``iters`` back-to-back calls (host included)."""
    for _ in range(warmup):
        fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        runs.append(1e3 * (time.perf_counter() - start) / iters)
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


ATTENTION_SHAPES = {  # label: (tokens, heads), head size 128
    "flux 1024^2": (4608, 24),
    "flux 256^2": (768, 24),
    "wan-1.3b 832x480x81": (32760, 12),
}


def attention_section(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Each SDPA backend alone (the context manager around the whole timed loop, so its host cost is not in the
    figure), omni's attention as the families call it, and omni's FP8 attention (``attention_dtype="fp8"``), with
    each one's relative L2 against torch's default order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omni_models.attention import attention, fp8_attention

    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = {"smoke": (64, 2)} if smoke else ATTENTION_SHAPES
    dim = 32 if smoke else 128
    out: dict[str, Any] = {}
    for label, (tokens, heads) in shapes.items():
        q, k, v = (torch.randn(1, tokens, heads, dim, device=device, dtype=dtype) for _ in range(3))

        def default() -> torch.Tensor:
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

        iters = 2 if smoke else max(5, int(50 * (4608 / tokens) ** 2))
        ref = default().transpose(1, 2).float()
        row: dict[str, Any] = {"tokens": tokens, "heads": heads, "default_ms": wall_ms(default, device, iters=iters)}
        candidates = {"omni": lambda: attention(q, k, v), "omni_fp8": lambda: fp8_attention(q, k, v)}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            candidates[f"sdpa_{backend.name.lower()}"] = (backend, default)
        for name, fn in candidates.items():
            backend = None
            if isinstance(fn, tuple):
                backend, fn = fn
            try:
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    timing = wall_ms(fn, device, iters=iters)
                    result = fn()
                    result = result.transpose(1, 2) if backend is not None else result
            except RuntimeError as exc:  # a backend that cannot run this shape here
                row[name] = {"error": str(exc).splitlines()[0]}
                continue
            timing["rel_l2_vs_default"] = float((result.float() - ref).norm() / ref.norm())
            timing["vs_default"] = row["default_ms"]["median"] / timing["median"]
            row[name] = timing
        out[label] = row
        print(
            f"attention {label}: default {row['default_ms']['median']:.3f} ms; "
            + ", ".join(
                f"{n} {r['median']:.3f} ms ({r['vs_default']:.2f}x, {r['rel_l2_vs_default']:.1e})"
                if "median" in r
                else f"{n}: {r['error']}"
                for n, r in row.items()
                if isinstance(r, dict) and n != "default_ms"
            )
        )
    return out


def fp8_section(device: torch.device, smoke: bool) -> dict[str, Any]:
    from fp8_cache import FP8Linear

    out: dict[str, Any] = {}
    shapes = (
        [(64, 32, 32)] if smoke else [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072), (768, 3072, 3072)]
    )
    dtype = torch.float32 if smoke else torch.bfloat16
    iters = 2 if smoke else 100
    for m, k, n in shapes:
        linear = torch.nn.Linear(k, n, device=device, dtype=dtype)
        x = torch.randn(m, k, device=device, dtype=dtype)
        row = FP8Linear.from_linear(linear, activation_scaling="row")
        tensor = FP8Linear.from_linear(linear, activation_scaling="tensor")
        with torch.no_grad():
            base = wall_ms(lambda: F.linear(x, linear.weight, linear.bias), device, iters=iters)
            # Alternating inputs: the memo holds only the last one, so each call quantizes its input.
            xs = [x.clone() for _ in range(2)]
            counter = iter(range(10**9))

            def fresh(module):
                return lambda: module(xs[next(counter) % 2])

            r = wall_ms(fresh(row), device, iters=iters)
            t = wall_ms(fresh(tensor), device, iters=iters)
            qkv_base = wall_ms(lambda: [F.linear(x, linear.weight, linear.bias) for _ in range(3)], device, iters=iters)
            qkv_row = wall_ms(lambda: [row(x) for _ in range(3)], device, iters=iters)
        label = f"{m}x{k}x{n}"
        out[label] = {
            "bf16_ms": base,
            "fp8_row_ms": r,
            "fp8_tensor_ms": t,
            "row_vs_bf16": base["median"] / r["median"],
            "tensor_vs_bf16": base["median"] / t["median"],
            "qkv_bf16_ms": qkv_base,
            "qkv_fp8_row_shared_input_ms": qkv_row,
            "qkv_row_vs_bf16": qkv_base["median"] / qkv_row["median"],
        }
        print(
            f"fp8 {label}: bf16 {base['median']:.3f} ms, row {r['median']:.3f} ({out[label]['row_vs_bf16']:.2f}x), "
            f"tensor {t['median']:.3f} ({out[label]['tensor_vs_bf16']:.2f}x); 3 on one input: "
            f"{out[label]['qkv_row_vs_bf16']:.2f}x"
        )
    return out


def blocks_section(device: torch.device, smoke: bool) -> dict[str, Any]:
    from diffusers import FluxTransformer2DModel

    from fp8_cache import quantize_model
    from omni_models.backends.flux import FAMILY, OmniFluxAttnProcessor
    from omni_models.compilation import CompileSettings, compile_count, compile_modules
    from omni_models.integrations import FAMILY_ACTIVATION_SCALING
    from omni_models.synthetic import random_parameters

    dtype = torch.float32 if smoke else torch.bfloat16
    config: dict[str, Any] = dict(num_layers=2, num_single_layers=4, guidance_embeds=True)
    if smoke:
        config.update(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32)
        config.update(axes_dims_rope=[4, 4, 8], in_channels=16)
    model = random_parameters(lambda: FluxTransformer2DModel(**config), device=device, dtype=dtype, seed=0)
    model.eval().requires_grad_(False)
    inner, txt_dim = model.inner_dim, model.config.joint_attention_dim
    sizes = {"1024^2": (8, 4) if smoke else (64, 4096), "256^2": (4, 4) if smoke else (16, 256)}
    text_len = 8 if smoke else 512

    def inputs(side_tokens: tuple[int, int]) -> dict[str, Any]:
        side, tokens = side_tokens
        ids = torch.zeros(side, side, 3)
        ids[..., 1] += torch.arange(side)[:, None]
        ids[..., 2] += torch.arange(side)[None, :]
        return dict(
            hidden_states=torch.randn(1, side * side, model.config.in_channels, device=device, dtype=dtype),
            encoder_hidden_states=torch.randn(1, text_len, txt_dim, device=device, dtype=dtype),
            pooled_projections=torch.randn(1, model.config.pooled_projection_dim, device=device, dtype=dtype),
            timestep=torch.tensor([0.5], device=device, dtype=dtype),
            guidance=torch.tensor([3.5], device=device),
            img_ids=ids.reshape(-1, 3).to(device, dtype),
            txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
            return_dict=False,
        )

    results: dict[str, Any] = {"config": config, "inner_dim": inner}
    iters = 1 if smoke else 10

    def time_all(name: str, module: torch.nn.Module) -> None:
        for label, st in sizes.items():
            kw = inputs(st)
            with torch.no_grad():
                start = time.perf_counter()
                module(**kw)
                sync(device)
                first = time.perf_counter() - start
                timing = wall_ms(lambda: module(**kw), device, iters=iters, warmup=1, repeats=3)
            results.setdefault(name, {})[label] = {"first_call_s": first, "ms": timing}
            print(f"blocks {name} {label}: {timing['median']:.2f} ms/forward (first call {first:.1f} s)")

    diffusers_processors = dict(model.attn_processors)
    time_all("diffusers_eager", model)
    model.set_attn_processor(OmniFluxAttnProcessor())
    time_all("omni_eager", model)
    fp8 = copy.deepcopy(model)
    quantize_model(fp8, ignore=FAMILY.declaration.fp8_ignore, activation_scaling=FAMILY_ACTIVATION_SCALING)
    time_all("omni_fp8_eager", fp8)
    settings = CompileSettings(backend="eager" if smoke else "inductor")
    for name, module in (("omni_compiled", model), ("omni_fp8_compiled", fp8)):
        blocks = [b for path in FAMILY.declaration.block_lists for b in module.get_submodule(path)]
        before = compile_count()
        compile_modules(blocks, settings)
        time_all(name, module)
        # Another row count and another size after both sizes ran: nothing may compile again.
        kw = inputs(sizes["256^2"])
        kw = {
            k: (
                torch.cat([v, v])
                if k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")
                else v
            )
            for k, v in kw.items()
        }
        mid = compile_count()
        with torch.no_grad():
            module(**kw)
        results[name]["graphs_compiled"] = mid - before
        results[name]["graphs_compiled_for_batch_2"] = compile_count() - mid
    model.set_attn_processor(diffusers_processors)
    for name in ("omni_eager", "omni_fp8_eager", "omni_compiled", "omni_fp8_compiled"):
        for label in sizes:
            base = results["diffusers_eager"][label]["ms"]["median"]
            results[name][label]["vs_diffusers_eager"] = base / results[name][label]["ms"]["median"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sections", nargs="+", default=["attention", "fp8_linear", "blocks"])
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    results["torch"] = torch.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    sections = {"attention": attention_section, "fp8_linear": fp8_section, "blocks": blocks_section}
    for name in args.sections:
        start = time.perf_counter()
        try:
            results[name] = sections[name](device, args.smoke)
        except Exception as exc:  # one broken section must not hide the others' figures
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name + "_s"] = time.perf_counter() - start
        (args.out / "fast_paths.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({k: v for k, v in results.items() if k.endswith("_s")}))


if __name__ == "__main__":
    main()
