"""FP8 cache warm start vs online quantization, and FP8 linear vs bf16 linear throughput.

Part 1 (time to FP8 weights resident on the device). A random ~1B-parameter bf16 DiT-like component is saved
as safetensors in a temp dir and an FP8 cache is built from it. Then, in the same process:
  - online/ordinary: safetensors ``safe_open().get_tensor()`` -> ``.to(device)`` -> quantize on the device
  - online/fast:     the library's pinned-staging reader for the bf16 source -> quantize on the device
  - warm (cache):    ``load_fp8_weights`` hit: validate the artifact, read FP8 bytes + scales, no quantization
Each path runs once untimed (allocates pinned staging, warms the page cache), then ``--repeats`` timed runs
(median reported), each ending in ``torch.cuda.synchronize``. A second set evicts every file from the page
cache first (``posix_fadvise(DONTNEED)``; honoured only for clean pages, so it is best-effort).
Warm tensors are checked bit-identical to online quantization.

Part 2 (GEMM throughput, CUDA only; CPU smoke runs the same code through the dequantizing fallback). Per
shape, all against bf16 ``nn.Linear`` in the same run:
- ``FP8Linear`` on a bf16 input, quantizing it itself: per tensor (two passes, the default, "fp8 ms") and per
  row (one pass, ``activation_scaling="row"``, "row ms");
- ``FP8Linear`` on an ``FP8Activation`` with per-row scales, as the fused op before it in the DiT writes it
  ("pre ms", the headline "x pre": no quantization pass of its own);
- the raw ``_scaled_mm`` on pre-quantized inputs, per tensor ("gemm ms") and rowwise ("rgemm ms"), the per-tensor
  activation quantizer alone ("actq ms"), and ``use_fast_accum=True`` for reference only ("fa ms").
Shapes: the 3072-wide DiT-like shapes (M = 4096 tokens) and the large causal-prefix DiT's own linears (M = 2048
tokens: 2 CFG rows x 1024 image tokens; qkv, proj, fc1, fc2). Timed with ``triton.testing.do_bench`` (median).
Then FP8Linear variants (bias fused/unfused, fp16/fp32 inputs, 3-D and empty inputs, per-row pre-quantized
inputs) are checked against the dequantized reference. ``--gemm-only`` skips part 1. The script exits 1 if
any correctness check fails.

Usage (GPU): python benchmarks/fp8_cache.py --out "$OUT"      Smoke (CPU): python benchmarks/fp8_cache.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This script is named like the package it measures; drop its own directory from the import path so that
# `import fp8_cache` finds the library, not this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fp8_cache import (  # noqa: E402
    FP8Linear,
    build_fp8_cache,
    load_fp8_weights,
    quantize_activation,
    quantize_activation_rows,
    quantize_state_dict,
)
from fp8_cache.build import read_source_specs, resolve_source_files, select_quantized  # noqa: E402
from fp8_cache.quant import per_tensor_scale, quantize_with_scale  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_source(directory: Path, *, hidden: int, blocks: int, files: int, device: torch.device) -> int:
    """A DiT-like component: per block qkv, proj, fc1, fc2 linears (+ biases, norm); returns parameter count."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {
        "attn.qkv": (3 * hidden, hidden),
        "attn.proj": (hidden, hidden),
        "mlp.fc1": (4 * hidden, hidden),
        "mlp.fc2": (hidden, 4 * hidden),
    }
    params = 0
    per_file: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    for b in range(blocks):
        part = per_file[b * files // blocks]
        for name, (out_f, in_f) in shapes.items():
            w = torch.randn(out_f, in_f, generator=g, device=device, dtype=torch.float32).mul_(in_f**-0.5)
            part[f"blocks.{b}.{name}.weight"] = w.to(torch.bfloat16).cpu()
            part[f"blocks.{b}.{name}.bias"] = torch.zeros(out_f, dtype=torch.bfloat16)
            params += out_f * in_f + out_f
        part[f"blocks.{b}.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        params += hidden
    for i, tensors in enumerate(per_file):
        save_file(tensors, str(directory / f"model-{i:05d}-of-{files:05d}.safetensors"))
    return params


def online_ordinary(files: list[str], quantized: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key).to(device, non_blocking=True)
    return quantize_state_dict(tensors, quantized)


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, device: torch.device, repeats: int, before=None) -> dict[str, float]:
    times = []
    for i in range(repeats + 1):  # run 0 is the untimed warm-up
        if before is not None:
            before()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def bench_load(args, device: torch.device, workdir: Path) -> dict:
    src = workdir / "source"
    cache = workdir / "cache"
    t0 = time.perf_counter()
    params = make_source(src, hidden=args.hidden, blocks=args.blocks, files=args.files, device=device)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    build = build_fp8_cache(src, cache, device=device)
    build_s = time.perf_counter() - t0
    files = resolve_source_files(src)
    quantized = select_quantized(read_source_specs(files))

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(
            torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
        )

    warm = load_fp8_weights(src, cache, device=device)
    assert warm.hit, warm.reason
    # Against the library's own online path, and against an independent reader (safetensors' get_tensor).
    identical = same(warm.tensors, load_fp8_weights(src, None, device=device).tensors)
    identical_ordinary = same(warm.tensors, online_ordinary(files, quantized, device))
    del warm

    all_files = [Path(f) for f in files] + sorted(cache.rglob("*.safetensors"))
    paths = {
        "online_ordinary": lambda: online_ordinary(files, quantized, device),
        "online_fast": lambda: load_fp8_weights(src, None, device=device),
        "warm_cache": lambda: load_fp8_weights(src, cache, device=device, publish=False),
    }
    results: dict[str, dict] = {"page_cache_hot": {}, "page_cache_evicted": {}}
    for regime, before in (("page_cache_hot", None), ("page_cache_evicted", lambda: evict(all_files))):
        for name, fn in paths.items():
            results[regime][name] = timed(fn, device, args.repeats, before)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    source_bytes = sum(os.path.getsize(f) for f in files)
    for regime in results.values():
        warm_s = regime["warm_cache"]["median_s"]
        regime["speedup_vs_online_ordinary"] = regime["online_ordinary"]["median_s"] / warm_s
        regime["speedup_vs_online_fast"] = regime["online_fast"]["median_s"] / warm_s
    return {
        "params": params,
        "source_bytes": source_bytes,
        "cache_bytes": build.manifest.total_size,
        "quantized_tensors": len(quantized),
        "generate_s": gen_s,
        "cold_build_s": build_s,
        "bit_identical": identical,
        "bit_identical_vs_ordinary_reader": identical_ordinary,
        **results,
    }


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    reps = 3
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def bench_gemm(shapes: list[tuple[str, int, int, int]], device: torch.device) -> list[dict]:
    rows = []
    for label, m, k, n in shapes:
        torch.manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(linear)
        fp8_row = FP8Linear.from_linear(linear, activation_scaling="row")
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            ref, out = linear(x), fp8(x)
            rel_err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            pre = quantize_activation_rows(x)  # what the fused producer op hands over
            rel_err_pre = ((fp8(pre).float() - ref.float()).norm() / ref.float().norm()).item()
            bf16_ms = _time_ms(lambda: linear(x), device)
            fp8_ms = _time_ms(lambda: fp8(x), device)
            pre_ms = _time_ms(lambda: fp8(pre), device)
            row_ms = _time_ms(lambda: fp8_row(x), device)
            row = {
                "shape": label,
                "M": m,
                "K": k,
                "N": n,
                "bf16_ms": bf16_ms,
                "fp8_linear_ms": fp8_ms,
                "fp8_linear_row_ms": row_ms,
                "fp8_prequantized_ms": pre_ms,
                "speedup_fp8_linear": bf16_ms / fp8_ms,
                "speedup_fp8_linear_row": bf16_ms / row_ms,
                "speedup_fp8_prequantized": bf16_ms / pre_ms,
                "rel_err_vs_bf16": rel_err,
                "rel_err_prequantized_vs_bf16": rel_err_pre,
            }
            if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
                xq, xs = quantize_activation(x)
                wt = fp8.weight.t()
                w_row = fp8.weight_scale.reshape(1, 1).expand(1, n).contiguous()
                gemm_ms = _time_ms(
                    lambda: torch._scaled_mm(xq, wt, scale_a=xs, scale_b=fp8.weight_scale, out_dtype=torch.bfloat16),
                    device,
                )
                rgemm_ms = _time_ms(
                    lambda: torch._scaled_mm(pre.data, wt, scale_a=pre.scale, scale_b=w_row, out_dtype=torch.bfloat16),
                    device,
                )
                fast_ms = _time_ms(
                    lambda: torch._scaled_mm(
                        xq, wt, scale_a=xs, scale_b=fp8.weight_scale, out_dtype=torch.bfloat16, use_fast_accum=True
                    ),
                    device,
                )
                quant_ms = _time_ms(lambda: quantize_activation(x), device)
                # The Triton activation quantizer against the exact torch expression (same scale rule).
                ref_scale = per_tensor_scale(x)
                ref_q = quantize_with_scale(x, ref_scale)
                same = (xq.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
                row.update(
                    scaled_mm_ms=gemm_ms,
                    speedup_gemm_only=bf16_ms / gemm_ms,
                    act_quant_ms=quant_ms,
                    scaled_mm_rowwise_ms=rgemm_ms,
                    speedup_rowwise_gemm_only=bf16_ms / rgemm_ms,
                    scaled_mm_fast_accum_ms=fast_ms,
                    act_quant_bytes_equal_torch=same,
                    act_scale_equal_torch=bool(torch.equal(xs, ref_scale)),
                )
            flops = 2.0 * m * n * k
            row["bf16_tflops"] = flops / bf16_ms / 1e9
            row["fp8_linear_tflops"] = flops / fp8_ms / 1e9
            row["fp8_prequantized_tflops"] = flops / pre_ms / 1e9
        rows.append(row)
    return rows


def module_checks(device: torch.device) -> dict[str, bool]:
    """FP8Linear variants on this device vs the dequantized reference (same FP8 weight, exact activations).

    Tolerance: per-tensor FP8 activation rounding (relative 2^-4 per product) plus bf16 output rounding.
    """
    torch.manual_seed(0)
    results = {}
    for label, dtype, bias, shape in [
        ("bf16_bias_3d", torch.bfloat16, True, (2, 37, 256)),
        ("bf16_no_bias", torch.bfloat16, False, (64, 256)),
        ("fp16_bias", torch.float16, True, (16, 256)),
        ("fp32_bias_unfused", torch.float32, True, (16, 256)),
        ("empty_batch", torch.bfloat16, True, (0, 256)),
    ]:
        linear = torch.nn.Linear(256, 128, bias=bias, device=device, dtype=dtype)
        fp8 = FP8Linear.from_linear(linear)
        x = torch.randn(*shape, device=device, dtype=dtype)
        with torch.inference_mode():
            out = fp8(x)
            w = fp8.weight.float() * fp8.weight_scale
            ref = x.double() @ w.double().t() + (fp8.bias.double() if bias else 0.0)
            bound = (x.double().abs() @ w.double().abs().t()) * (2.0**-4 + 2.0**-7) + 1e-3
        results[label] = bool(
            out.shape == ref.shape and out.dtype == dtype and ((out.double() - ref).abs() <= bound).all().item()
        )
    # Per-row pre-quantized inputs (the fused producers' output): the product of the stored FP8 values.
    for label, bias in (("bf16_prequantized_rows_bias", True), ("bf16_prequantized_rows_no_bias", False)):
        linear = torch.nn.Linear(256, 128, bias=bias, device=device, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(linear)
        act = quantize_activation_rows(torch.randn(2, 37, 256, device=device, dtype=torch.bfloat16) * 3)
        with torch.inference_mode():
            out = fp8(act)
            x = act.data.double() * act.scale.double().reshape(2, 37, 1)
            w = fp8.weight.double() * fp8.weight_scale.double()
            ref = x @ w.t() + (fp8.bias.double() if bias else 0.0)
            bound = (x.abs() @ w.abs().t()) * 2.0**-7 + 1e-3  # bf16 output rounding only
        results[label] = bool(
            out.shape == (2, 37, 128)
            and out.dtype == torch.bfloat16
            and ((out.double() - ref).abs() <= bound).all().item()
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for fp8_cache.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (checks the script runs)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--blocks", type=int, default=9, help="9 blocks of hidden 3072 ~ 1.02B parameters")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    parser.add_argument("--gemm-only", action="store_true", help="skip part 1 (cache load times)")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.blocks, args.files, args.repeats = 64, 2, 2, 1
        device = torch.device(args.device or "cpu")
        shapes = [("smoke", 64, 64, 64), ("smoke", 32, 64, 256)]
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        shapes = [
            ("square", 8192, 8192, 8192),
            ("dit3072.proj", 4096, 3072, 3072),
            ("dit3072.fc1", 4096, 3072, 12288),
            ("dit3072.fc2", 4096, 12288, 3072),
            ("large.qkv", 2048, 2048, 6144),
            ("large.proj", 2048, 2048, 2048),
            ("large.fc1", 2048, 2048, 8192),
            ("large.fc2", 2048, 8192, 2048),
        ]
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "smoke": args.smoke,
    }

    load = None
    if not args.gemm_only:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            load = bench_load(args, device, Path(tmp))
    gemm = bench_gemm(shapes, device)
    checks = module_checks(device)

    print(f"# fp8_cache on {meta['device']} (torch {meta['torch']})")
    if load is not None:
        print(
            f"model: {load['params'] / 1e9:.3f} B params, source {load['source_bytes'] / 2**30:.2f} GiB bf16, "
            f"cache {load['cache_bytes'] / 2**30:.2f} GiB; cold build {load['cold_build_s']:.2f} s; "
            f"warm == online bit-identical: {load['bit_identical']} "
            f"(vs safetensors reader: {load['bit_identical_vs_ordinary_reader']})"
        )
        print(
            f"{'regime':<20}{'online_ordinary s':>19}{'online_fast s':>15}{'warm_cache s':>14}"
            f"{'x vs ordinary':>15}{'x vs fast':>11}"
        )
        for regime in ("page_cache_hot", "page_cache_evicted"):
            r = load[regime]
            print(
                f"{regime:<20}{r['online_ordinary']['median_s']:>19.3f}{r['online_fast']['median_s']:>15.3f}"
                f"{r['warm_cache']['median_s']:>14.3f}{r['speedup_vs_online_ordinary']:>15.2f}"
                f"{r['speedup_vs_online_fast']:>11.2f}"
            )
    nan = float("nan")
    print(
        f"{'shape':<13}{'M x K x N':<18}{'bf16 ms':>9}{'fp8 ms':>8}{'x':>6}{'row ms':>8}{'x':>6}{'pre ms':>8}"
        f"{'x pre':>7}{'gemm ms':>8}{'rgemm ms':>9}{'actq ms':>8}{'fa ms':>7}{'bf16 TF':>8}{'pre TF':>8}"
        f"{'rel err':>8}"
    )
    for r in gemm:
        print(
            f"{r['shape']:<13}{r['M']}x{r['K']}x{r['N']:<8}{r['bf16_ms']:>9.3f}{r['fp8_linear_ms']:>8.3f}"
            f"{r['speedup_fp8_linear']:>6.2f}{r['fp8_linear_row_ms']:>8.3f}{r['speedup_fp8_linear_row']:>6.2f}"
            f"{r['fp8_prequantized_ms']:>8.3f}{r['speedup_fp8_prequantized']:>7.2f}"
            f"{r.get('scaled_mm_ms', nan):>8.3f}{r.get('scaled_mm_rowwise_ms', nan):>9.3f}"
            f"{r.get('act_quant_ms', nan):>8.3f}{r.get('scaled_mm_fast_accum_ms', nan):>7.3f}"
            f"{r['bf16_tflops']:>8.1f}{r['fp8_prequantized_tflops']:>8.1f}{r['rel_err_vs_bf16']:>8.4f}"
        )
    act = [(r["act_quant_bytes_equal_torch"], r["act_scale_equal_torch"]) for r in gemm if "act_quant_ms" in r]
    if act:
        print(
            f"Triton activation quantizer vs torch: scale equal {all(c[1] for c in act)}, "
            f"min fraction of identical FP8 bytes {min(c[0] for c in act):.6f}"
        )
    print(
        "FP8Linear checks vs dequantized reference: "
        + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checks.items())
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_cache.json").write_text(
            json.dumps({"meta": meta, "load": load, "gemm": gemm, "module_checks": checks}, indent=2)
        )
    # A wrong result makes the timing meaningless: fail loudly.
    ok = all(checks.values()) and (load is None or (load["bit_identical"] and load["bit_identical_vs_ordinary_reader"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
