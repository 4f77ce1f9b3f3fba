"""The indexed adaLN modulation ops (omni_models.fused) vs the unfused torch sequence, with GB/s against HBM.

Tokens of R requests at different timesteps share one forward: every token reads its own request's modulation
row by index. Per shape (tokens T, width W, rows R, bf16):
- `ln_mod`: LayerNorm(x) * (1 + scale[row]) + shift[row] -> bf16; unfused: `F.layer_norm`, two
  `index_select` gathers, `1 + scale`, multiply, add (what the DiT block ran before the fused ops);
- `ln_mod_fp8`: the same, written as FP8 with one scale per token; unfused: the sequence above, then
  fp8_cache's per-row quantizer (its fastest, one Triton pass);
- `residual_ln_mod`: x + gate[row] * branch, then LayerNorm + modulation of the result (both outputs);
- `gelu_fp8`: tanh-GELU of the fc1 output quantized per token; unfused: `F.gelu`, then the per-row quantizer.
GB/s counts the fewest bytes each op must move (token tensors read once, outputs written once; the [R, W]
modulation rows are negligible) over the fused op's median time, against a device-to-device copy measured in
the same run (bytes read + written). Every fused result is checked against the float32 torch reference.

    PYTHONPATH=packages/fp8-cache/src:packages/models/src python benchmarks/modulation.py --out OUT
    python benchmarks/modulation.py --smoke       # tiny sizes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before omni_models._fused_triton is imported

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # benchmarks/fp8_cache.py shadows fp8_cache

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fp8_cache import quantize_activation_rows  # noqa: E402
from omni_models import fused  # noqa: E402

EPS = 1e-6


def timer_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def unfused_ln_mod(x, shift, scale, ids):
    return F.layer_norm(x, (x.shape[1],), eps=EPS) * (1 + scale.index_select(0, ids)) + shift.index_select(0, ids)


def run_shape(tokens: int, width: int, rows: int, device: str, backend: str, gen: torch.Generator) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(tokens, width, generator=gen).to(device, dtype)
    branch = torch.randn(tokens, width, generator=gen).to(device, dtype)
    hidden = torch.randn(tokens, 4 * width, generator=gen).to(device, dtype)
    modulation = (0.5 * torch.randn(rows, 6 * width, generator=gen)).to(device, dtype)
    shift, scale, gate, shift2, scale2, _ = modulation.chunk(6, dim=-1)
    ids = torch.randint(rows, (tokens,), generator=gen).to(device)

    ops = {
        "ln_mod": (
            lambda: fused.layer_norm_modulate(x, shift, scale, ids, eps=EPS, backend=backend),
            lambda: unfused_ln_mod(x, shift, scale, ids),
            tokens * width * (2 + 2),
        ),
        "ln_mod_fp8": (
            lambda: fused.layer_norm_modulate(x, shift, scale, ids, eps=EPS, quantize=True, backend=backend),
            lambda: quantize_activation_rows(unfused_ln_mod(x, shift, scale, ids)),
            tokens * width * (2 + 1) + tokens * 4,
        ),
        "residual_ln_mod": (
            lambda: fused.gated_residual_layer_norm_modulate(
                x, gate, branch, shift2, scale2, ids, eps=EPS, backend=backend
            ),
            lambda: (lambda r: (r, unfused_ln_mod(r, shift2, scale2, ids)))(x + gate.index_select(0, ids) * branch),
            tokens * width * (2 + 2 + 2 + 2),
        ),
        "gelu_fp8": (
            lambda: fused.gelu_quantize(hidden, backend=backend),
            lambda: quantize_activation_rows(F.gelu(hidden, approximate="tanh")),
            tokens * 4 * width * (2 + 1) + tokens * 4,
        ),
    }
    # Correctness against the float32 torch reference (fresh inputs above; outputs compared as float).
    checks = {}
    ref = fused.layer_norm_modulate(x, shift, scale, ids, eps=EPS, backend="torch")
    got = ops["ln_mod"][0]()
    checks["ln_mod_max_abs_err"] = (got.float() - ref.float()).abs().max().item()
    ref_q = fused.layer_norm_modulate(x, shift, scale, ids, eps=EPS, quantize=True, backend="torch")
    got_q = ops["ln_mod_fp8"][0]()
    checks["ln_mod_fp8_scale_max_rel_err"] = ((got_q.scale - ref_q.scale).abs() / ref_q.scale).max().item()
    checks["ln_mod_fp8_dequant_rel_l2"] = (
        (got_q.dequantize().float() - ref.float()).norm() / ref.float().norm()
    ).item()
    ref_r, ref_m = fused.gated_residual_layer_norm_modulate(
        x, gate, branch, shift2, scale2, ids, eps=EPS, backend="torch"
    )
    got_r, got_m = ops["residual_ln_mod"][0]()
    checks["residual_max_abs_err"] = (got_r.float() - ref_r.float()).abs().max().item()
    checks["residual_ln_mod_max_abs_err"] = (got_m.float() - ref_m.float()).abs().max().item()
    ref_g = F.gelu(hidden.float(), approximate="tanh")
    got_g = ops["gelu_fp8"][0]()
    checks["gelu_fp8_dequant_rel_l2"] = ((got_g.dequantize().float() - ref_g).norm() / ref_g.norm()).item()

    results = {"tokens": tokens, "width": width, "rows": rows, "checks": checks, "ops": {}}
    for name, (fused_fn, unfused_fn, nbytes) in ops.items():
        fused_ms = timer_ms(fused_fn, device)
        unfused_ms = timer_ms(unfused_fn, device)
        results["ops"][name] = {
            "fused_ms": fused_ms,
            "unfused_ms": unfused_ms,
            "speedup": unfused_ms / fused_ms,
            "bytes": nbytes,
            "fused_gbps": nbytes / fused_ms / 1e6,
        }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for modulation.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)")
    args = parser.parse_args()
    if SMOKE:
        device, backend = "cpu", "triton"
        shapes = [(8, 48, 3)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("modulation benchmark needs CUDA; use --smoke for a CPU check")
        device, backend = "cuda", "auto"
        shapes = [(2048, 2048, 2), (16384, 2048, 8), (16384, 3072, 8)]
    gen = torch.Generator().manual_seed(0)
    copy_gbps = copy_bandwidth(device, 2 * 1024**3 if device == "cuda" else 1024**2)
    with torch.inference_mode():
        results = [run_shape(t, w, r, device, backend, gen) for t, w, r in shapes]
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "timer": "triton.testing.do_bench median" if device == "cuda" else "perf_counter",
    }
    print(f"# indexed adaLN modulation on {meta['device']}; device-to-device copy {copy_gbps:.0f} GB/s (read+write)")
    print(f"{'T':>6} {'W':>5} {'R':>2} {'op':<16}{'unfused ms':>11}{'fused ms':>10}{'x':>7}{'GB/s':>8}{'% copy':>8}")
    for r in results:
        for name, op in r["ops"].items():
            print(
                f"{r['tokens']:>6} {r['width']:>5} {r['rows']:>2} {name:<16}{op['unfused_ms']:>11.4f}"
                f"{op['fused_ms']:>10.4f}{op['speedup']:>7.2f}{op['fused_gbps']:>8.0f}"
                f"{op['fused_gbps'] / copy_gbps:>8.0%}"
            )
        print("   checks: " + ", ".join(f"{k}={v:.2e}" for k, v in r["checks"].items()))
    # FP8 rounding (3 mantissa bits) costs a few % relative L2; the interpreter's float->fp8 cast is coarser.
    fp8_tol = 0.15 if SMOKE else 0.05
    ok = all(
        r["checks"]["ln_mod_fp8_scale_max_rel_err"] < 1e-3
        and r["checks"]["ln_mod_fp8_dequant_rel_l2"] < fp8_tol
        and r["checks"]["gelu_fp8_dequant_rel_l2"] < fp8_tol
        and r["checks"]["ln_mod_max_abs_err"] < 0.1
        and r["checks"]["residual_ln_mod_max_abs_err"] < 0.1
        for r in results
    )
    print(f"correctness vs float32 reference: {'ok' if ok else 'FAIL'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "modulation.json").write_text(json.dumps({"meta": meta, "results": results, "ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
