"""Paged non-causal attention (diffusion_kv Triton kernels) vs every SDPA backend torch has, bf16 and FP8.

Identical work for all: bf16, 24 heads x 128, batch B rows of S tokens each (B = max(1, 16384 // S)), every
query attending all S keys of its row. The paged side reads K/V from a pool of `page`-token blocks through
shuffled (non-contiguous) block tables; the dense side gets its own best layout of contiguous K/V.

Baseline: each SDPA backend (flash, memory-efficient, cuDNN, math) is timed on the token-major layout a model
passes (`[B, S, H, D]` transposed views) and on contiguous head-major `[B, H, S, D]` tensors; a backend's figure
is the faster of the two, and the fastest backend is named the baseline of the shape. Backends that refuse the
shape (or would not fit: math beyond 8 GiB of scores) are listed with the reason.

Paged kernels, all through the same block tables:
- `generic`: `triton_kernels` (pointer loads, any page size), autotuned as shipped;
- `flash[...]`: `triton_flash` (TMA descriptor loads, wgmma), every tile config it autotunes over, each timed
  on its own (a config that fails to compile is listed with its error), and `flash` autotuned;
- causal-prefix mode (a 1024-token causal prefix, and S/2) with the best flash config: its time against the same
  config's non-causal time (fewer pairs to compute, so at most 1.0 is expected; the target is <= 1.1);
- FP8 (`fp8_attention`, e4m3 Q/K/V, per-head scales) at S >= 8k against the best bf16 flash time, with its
  error against the bf16 kernel's output (relative L2 and max abs);
- `sdpa_gather`: the op's gather + SDPA path (each row's pages copied into contiguous K/V, then torch's default
  SDPA dispatch, cuDNN on the H200), the path `backend="auto"` takes on CUDA for rows of >= 512 queries and
  more than 4096 keys; its time includes the gather;
- `cudnn_paged`: cuDNN's own paged SDPA reading the pages in place (`backend="cudnn"`, needs the optional
  `nvidia-cudnn-frontend`), what `"auto"` takes for rows of at most 4096 keys.
Repeats (`--repeats`, default 5): the baseline, `sdpa_gather`, `cudnn_paged`, the best flash config and the best
FP8 config are then timed again that many times each, interleaved; the summary's ratios are medians of those
repeats, with their spread.
Correctness: every paged output is poisoned (NaN) before the run and compared with SDPA's output.
Timed with `triton.testing.do_bench` (CUDA events, median); the first call of a config also compiles it.

    PYTHONPATH=packages/diffusion-kv/src python benchmarks/paged_attention.py --out OUT
    python benchmarks/paged_attention.py --smoke      # tiny CPU run (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from diffusion_kv import PagedAttentionMetadata, write_kv_cache  # noqa: E402
from diffusion_kv.ops import cudnn_paged, fp8_attention, sdpa_gather, triton_flash, triton_kernels  # noqa: E402

TOKENS_PER_SHAPE = 16384
MATH_MAX_SCORE_BYTES = 8 * 1024**3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for paged_attention.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=5, help="re-timings of the headline variants per shape")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--fp8-min-seq", type=int, default=8192)
    return parser.parse_args()


def timer_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=150, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def sdpa_layout(q, k, v, layout: str) -> tuple:
    """`[B, S, H, D]` Q/K/V as SDPA's `[B, H, S, D]`: transposed views ("token-major") or contiguous copies."""
    tensors = tuple(t.transpose(1, 2) for t in (q, k, v))
    return tuple(t.contiguous() for t in tensors) if layout == "head-major" else tensors


def sdpa_backends(q, k, v, device: str) -> dict:
    """{backend: {"ms", "layout"} or {"error"}} for every SDPA backend on the best of two layouts."""
    if device != "cuda":
        return {
            "default": {
                "ms": timer_ms(
                    lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
                    device,
                ),
                "layout": "token-major",
            }
        }
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layouts = {layout: sdpa_layout(q, k, v, layout) for layout in ("token-major", "head-major")}
    results = {}
    batch, seq, heads, _ = q.shape
    for backend in (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ):
        name = backend.name.lower()
        if backend == SDPBackend.MATH and batch * heads * seq * seq * 2 > MATH_MAX_SCORE_BYTES:
            results[name] = {"error": f"skipped: {batch * heads * seq * seq * 2 / 2**30:.0f} GiB of scores"}
            continue
        best = None
        errors = []
        for layout, (qq, kk, vv) in layouts.items():
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qq, kk, vv)
                    ms = timer_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv), device)
            except RuntimeError as exc:
                errors.append(f"{layout}: {str(exc).splitlines()[0][:160]}")
                continue
            if best is None or ms < best["ms"]:
                best = {"ms": ms, "layout": layout}
        results[name] = best if best is not None else {"error": "; ".join(errors)}
        torch.cuda.empty_cache()
    return results


def flash_configs(fp8: bool = False) -> list[dict]:
    if triton_flash.INTERPRETED:
        return [dict(triton_flash._FIXED_TILE)]
    source = triton_flash._fp8_cuda_configs() if fp8 else triton_flash._cuda_configs()
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in source]


def config_name(config: dict, kernel: str = "flash") -> str:
    return (
        f"{kernel}[{config['BLOCK_M']}x{config['BLOCK_N']},w{config.get('num_warps', 4)},"
        f"s{config.get('num_stages', 3)}]"
    )


class Shape:
    """One (B, S, page) problem: dense Q/K/V, the shuffled paged cache, row metadata and an SDPA reference."""

    def __init__(self, batch, seq_len, page, heads, head_size, dtype, device, gen):
        self.batch, self.seq_len, self.page, self.heads, self.head_size = batch, seq_len, page, heads, head_size
        self.device = device
        self.q, self.k, self.v = (
            torch.randn(batch, seq_len, heads, head_size, generator=gen).to(device, dtype) for _ in range(3)
        )
        blocks_per_row = seq_len // page
        num_blocks = batch * blocks_per_row
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_tables = perm.view(batch, blocks_per_row).to(device=device, dtype=torch.int32)
        self.kv_cache = torch.empty(num_blocks, 2, page, heads, head_size, device=device, dtype=dtype)
        # Every query of a row attends to all of its keys: one metadata both writes the rows and attends.
        self.metadata = self.metadata_with(None)
        self.keys = self.k.reshape(-1, heads, head_size)
        self.values = self.v.reshape(-1, heads, head_size)
        write_kv_cache(self.keys, self.values, self.kv_cache, self.metadata)
        self.query = self.q.reshape(-1, heads, head_size)
        self.scale = head_size**-0.5
        self.flops = 4.0 * batch * heads * seq_len * seq_len * head_size
        reference = F.scaled_dot_product_attention(
            self.q.transpose(1, 2), self.k.transpose(1, 2), self.v.transpose(1, 2)
        )
        self.reference = reference.transpose(1, 2).reshape(-1, heads, head_size).float()

    def metadata_with(self, causal_prefix_len: int | None) -> PagedAttentionMetadata:
        rows = self.batch
        return PagedAttentionMetadata.build(
            self.block_tables,
            block_size=self.page,
            query_lens=[self.seq_len] * rows,
            seq_lens=[self.seq_len] * rows,
            query_pos_start=[0] * rows,
            causal_prefix_lens=None if causal_prefix_len is None else [causal_prefix_len] * rows,
        )

    def fp8_inputs(self) -> tuple:
        """`(query, q_scale, cache, k_scale, v_scale)`: the shape's Q/K/V in e4m3 with per-head scales."""
        k_scale = fp8_attention.per_head_scales(self.keys)
        v_scale = fp8_attention.per_head_scales(self.values)
        q_scale = fp8_attention.per_head_scales(self.query)
        cache = torch.empty(self.kv_cache.shape, dtype=fp8_attention.FP8_DTYPE, device=self.device)
        fp8_attention.write_kv_cache_fp8(self.keys, self.values, cache, self.metadata, k_scale, v_scale)
        return fp8_attention.quantize_per_head(self.query, q_scale), q_scale, cache, k_scale, v_scale

    @staticmethod
    def caller(kernel: str, config: dict | None, args: tuple):
        def call():
            if kernel == "generic":
                triton_kernels.paged_attention(*args)
            elif kernel == "sdpa_gather":
                sdpa_gather.paged_attention(*args)
            elif kernel == "cudnn_paged":
                cudnn_paged.paged_attention(*args)
            else:
                triton_flash.paged_attention(*args, config=config)

        return call

    def run(self, kernel: str, config: dict | None = None, causal_prefix_len: int | None = None) -> dict:
        out = torch.full_like(self.query, float("nan"))
        metadata = self.metadata if causal_prefix_len is None else self.metadata_with(causal_prefix_len)
        args = (self.query, self.kv_cache, metadata, self.scale, out)

        call = self.caller(kernel, config, args)
        call()  # compiles (and autotunes when config is None)
        result = {"written": bool(not out.isnan().any())}
        if causal_prefix_len is None:
            diff = out.float() - self.reference
            result.update(max_abs_err=diff.abs().max().item(), rel_l2_err=(diff.norm() / self.reference.norm()).item())
        result["ms"] = timer_ms(call, self.device)
        result["tflops"] = self.flops / result["ms"] / 1e9
        return result


def fp8_case(shape: Shape, bf16_out: torch.Tensor, configs: list[dict]) -> dict:
    """FP8 cache and queries with per-head scales; every FP8 config timed; error against the bf16 kernel."""
    query, q_scale, cache, k_scale, v_scale = shape.fp8_inputs()
    results = {}
    for config in configs:
        name = config_name(config, "fp8")
        out = torch.full(shape.query.shape, float("nan"), dtype=torch.bfloat16, device=shape.device)

        def call(config=config, out=out):
            triton_flash.paged_attention_fp8(
                query, q_scale, cache, k_scale, v_scale, shape.metadata, shape.scale, out, config=config
            )

        try:
            call()
        except Exception as exc:  # a config the compiler rejects is a result, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        diff = out.float() - bf16_out.float()
        results[name] = {
            "written": bool(not out.isnan().any()),
            "rel_l2_vs_bf16_kernel": (diff.norm() / bf16_out.float().norm()).item(),
            "max_abs_vs_bf16_kernel": diff.abs().max().item(),
            "rel_l2_vs_sdpa": ((out.float() - shape.reference).norm() / shape.reference.norm()).item(),
            "ms": timer_ms(call, shape.device),
        }
        results[name]["tflops"] = shape.flops / results[name]["ms"] / 1e9
    return results


def sdpa_call(shape: Shape, backend: str, layout: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tensors = sdpa_layout(shape.q, shape.k, shape.v, layout)
    chosen = getattr(SDPBackend, backend.upper())

    def call():
        with sdpa_kernel(chosen):
            F.scaled_dot_product_attention(*tensors)

    return call


def repeated(shape: Shape, entry: dict, best_config: dict | None, repeats: int) -> dict:
    """The headline variants timed `repeats` times each, interleaved: median, min, max (ms) and median ratios."""
    out = torch.empty_like(shape.query)
    args = (shape.query, shape.kv_cache, shape.metadata, shape.scale, out)
    calls = {
        "baseline": sdpa_call(shape, entry["baseline"]["backend"], entry["baseline"]["layout"]),
        "sdpa_gather": Shape.caller("sdpa_gather", None, args),
    }
    if "ms" in entry["paged"]["cudnn_paged"]:
        calls["cudnn_paged"] = Shape.caller("cudnn_paged", None, args)
    if best_config is not None:
        calls["best_flash"] = Shape.caller("flash", best_config, args)
    best_fp8 = entry.get("best_fp8")
    if best_fp8 is not None:
        config = next(c for c in flash_configs(fp8=True) if config_name(c, "fp8") == best_fp8)
        query, q_scale, cache, k_scale, v_scale = shape.fp8_inputs()
        calls["best_fp8"] = lambda: triton_flash.paged_attention_fp8(
            query, q_scale, cache, k_scale, v_scale, shape.metadata, shape.scale, out, config=config
        )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timer_ms(call, shape.device))
    summary = {
        name: {"ms_median": statistics.median(t), "ms_min": min(t), "ms_max": max(t), "ms_all": t}
        for name, t in times.items()
    }
    base = summary["baseline"]["ms_median"]
    for name, timing in summary.items():
        timing["tflops_median"] = shape.flops / timing["ms_median"] / 1e9
        if name not in ("baseline", "best_fp8"):
            timing["x_baseline"] = base / timing["ms_median"]
            timing["x_baseline_range"] = [base / timing["ms_max"], base / timing["ms_min"]]
    if "best_fp8" in summary and "best_flash" in summary:
        summary["best_fp8"]["x_best_flash"] = summary["best_flash"]["ms_median"] / summary["best_fp8"]["ms_median"]
    summary["repeats"] = repeats
    return summary


def main() -> int:
    args = parse_args()
    if SMOKE:
        device, heads, head_size, dtype = "cpu", 2, 32, torch.float16
        seq_lens, pages, fp8_min = [64], [16, 32], 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("paged_attention benchmark needs CUDA; use --smoke for a CPU check")
        device, heads, head_size, dtype = "cuda", 24, 128, torch.bfloat16
        seq_lens, pages, fp8_min = args.seq_lens, args.page_sizes, args.fp8_min_seq
    gen = torch.Generator().manual_seed(0)
    results = []
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "baseline": "fastest SDPA backend per shape, each on the better of token-major and head-major layouts",
        "timer": "triton.testing.do_bench(warmup=25, rep=150, median)" if device == "cuda" else "perf_counter, 1 run",
    }

    def save() -> None:  # after every shape: a step stopped at its time limit keeps what it measured
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "paged_attention.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))

    for seq_len in seq_lens:
        batch = max(1, TOKENS_PER_SHAPE // seq_len) if not SMOKE else 2
        dense_done = None
        for page in pages:
            shape = Shape(batch, seq_len, page, heads, head_size, dtype, device, gen)
            entry = {
                "seq_len": seq_len,
                "page_size": page,
                "batch": batch,
                "heads": heads,
                "head_size": head_size,
                "dtype": str(dtype).removeprefix("torch."),
                "flops": shape.flops,
            }
            if dense_done is None:  # SDPA does not depend on the page size: time it once per S
                dense_done = sdpa_backends(shape.q, shape.k, shape.v, device)
                for backend in dense_done.values():
                    if "ms" in backend:
                        backend["tflops"] = shape.flops / backend["ms"] / 1e9
            entry["sdpa"] = dense_done
            timed = {k: v for k, v in dense_done.items() if "ms" in v}
            best_name = min(timed, key=lambda k: timed[k]["ms"])
            entry["baseline"] = {"backend": best_name, **timed[best_name]}
            kernels = {"generic": shape.run("generic"), "sdpa_gather": shape.run("sdpa_gather")}
            cudnn_reason = cudnn_paged.unsupported_reason(shape.query, shape.kv_cache, shape.metadata)
            kernels["cudnn_paged"] = (
                shape.run("cudnn_paged") if cudnn_reason is None else {"error": f"declined: {cudnn_reason}"}
            )
            for config in flash_configs():
                if page % config["BLOCK_N"]:
                    continue
                try:
                    kernels[config_name(config)] = shape.run("flash", config)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    kernels[config_name(config)] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            if not SMOKE:
                try:
                    kernels["flash"] = shape.run("flash")  # autotuned over every config
                except Exception as exc:  # noqa: BLE001
                    kernels["flash"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            entry["paged"] = kernels
            entry["ratio_sdpa_gather_vs_baseline"] = entry["baseline"]["ms"] / kernels["sdpa_gather"]["ms"]
            if "ms" in kernels["cudnn_paged"]:
                entry["ratio_cudnn_paged_vs_baseline"] = entry["baseline"]["ms"] / kernels["cudnn_paged"]["ms"]
            ok = {k: v for k, v in kernels.items() if "ms" in v and k not in ("generic", "sdpa_gather", "cudnn_paged")}
            best_flash = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
            entry["best_paged"] = best_flash
            if best_flash is not None:
                entry["ratio_best_paged_vs_baseline"] = entry["baseline"]["ms"] / ok[best_flash]["ms"]
                best_config = next((c for c in flash_configs() if config_name(c) == best_flash), None)
                if best_config is None:  # the autotuned kernel won: time causal with the best pinned config
                    pinned = {k: v for k, v in ok.items() if k != "flash"}
                    best_config = next(
                        (
                            c
                            for c in flash_configs()
                            if pinned and config_name(c) == min(pinned, key=lambda k: pinned[k]["ms"])
                        ),
                        None,
                    )
                causal = {}
                for label, length in (("prefix1024", min(1024, seq_len)), ("prefix_half", seq_len // 2)):
                    run = shape.run("flash", best_config, causal_prefix_len=length)
                    del run["tflops"]  # counted with the non-causal FLOPs: meaningless here
                    run["time_vs_noncausal"] = run["ms"] / ok[best_flash]["ms"]
                    causal[label] = run
                entry["causal_prefix"] = causal
                if seq_len >= fp8_min:
                    bf16_out = torch.empty_like(shape.query)
                    triton_flash.paged_attention(
                        shape.query, shape.kv_cache, shape.metadata, shape.scale, bf16_out, config=best_config
                    )
                    fp8 = fp8_case(shape, bf16_out, [c for c in flash_configs(fp8=True) if page % c["BLOCK_N"] == 0])
                    entry["fp8"] = fp8
                    fp8_ok = {k: v for k, v in fp8.items() if "ms" in v}
                    if fp8_ok:
                        best_fp8 = min(fp8_ok, key=lambda k: fp8_ok[k]["ms"])
                        entry["best_fp8"] = best_fp8
                        entry["ratio_fp8_vs_best_bf16_paged"] = ok[best_flash]["ms"] / fp8_ok[best_fp8]["ms"]
                if not SMOKE and args.repeats > 1:
                    entry["repeated"] = repeated(shape, entry, best_config, args.repeats)
            results.append(entry)
            print_entry(entry)
            save()
            del shape
            if device == "cuda":
                torch.cuda.empty_cache()
    print_summary(results)
    ok = all(
        v.get("written", True) and v.get("max_abs_err", 0.0) < 0.05
        for r in results
        for v in r["paged"].values()
        if "ms" in v
    )
    print_repeated(results)
    print(f"paged outputs fully written and within 0.05 of SDPA: {'ok' if ok else 'FAIL'}")
    meta["all_written_and_close"] = ok
    save()
    return 0 if ok else 1


def print_entry(entry: dict) -> None:
    head = f"S={entry['seq_len']} page={entry['page_size']} B={entry['batch']}"
    base_ms = entry["baseline"]["ms"]
    sdpa = ", ".join(f"{k} {v['tflops']:.0f}" if "tflops" in v else f"{k} -" for k, v in entry["sdpa"].items())
    print(f"{head}: SDPA TFLOP/s {sdpa}; baseline {entry['baseline']['backend']}", flush=True)
    for name, run in entry["paged"].items():
        if "ms" in run:
            err = f" err {run['max_abs_err']:.1e}" if "max_abs_err" in run else ""
            print(f"    {name:<34}{run['tflops']:>8.1f} TFLOP/s {base_ms / run['ms']:>6.3f}x{err}", flush=True)
        else:
            print(f"    {name:<34} {run['error']}", flush=True)
    for label, run in entry.get("causal_prefix", {}).items():
        print(f"    causal {label:<27} {run['ms']:.3f} ms, {run['time_vs_noncausal']:.3f}x the non-causal time")
    for name, run in entry.get("fp8", {}).items():
        if "ms" in run:
            print(f"    {name:<34}{run['tflops']:>8.1f} TFLOP/s, rel L2 vs bf16 {run['rel_l2_vs_bf16_kernel']:.2e}")
        else:
            print(f"    {name:<34} {run['error']}")


def print_summary(results: list[dict]) -> None:
    print(
        f"\n{'S':>6} {'page':>5} {'B':>2} {'baseline':>10} {'base TF':>8} {'generic TF':>10} {'best paged':<34}"
        f"{'TF':>7} {'x base':>7} {'causal x':>9} {'fp8 TF':>7} {'fp8 x':>6} {'fp8 err':>8} {'gather x':>9} "
        f"{'cudnn x':>8}"
    )
    for r in results:
        best = r.get("best_paged")
        paged = r["paged"].get(best, {}) if best else {}
        causal = r.get("causal_prefix", {}).get("prefix1024", {})
        fp8 = r.get("fp8", {}).get(r.get("best_fp8"), {}) if r.get("best_fp8") else {}
        generic = r["paged"].get("generic", {})
        print(
            f"{r['seq_len']:>6} {r['page_size']:>5} {r['batch']:>2} {r['baseline']['backend']:>10} "
            f"{r['baseline']['tflops']:>8.1f} {generic.get('tflops', float('nan')):>10.1f} {str(best):<34}"
            f"{paged.get('tflops', float('nan')):>7.1f} {r.get('ratio_best_paged_vs_baseline', float('nan')):>6.3f}x"
            f" {causal.get('time_vs_noncausal', float('nan')):>8.3f}x {fp8.get('tflops', float('nan')):>7.1f} "
            f"{r.get('ratio_fp8_vs_best_bf16_paged', float('nan')):>5.2f}x "
            f"{fp8.get('rel_l2_vs_bf16_kernel', float('nan')):>8.1e} "
            f"{r.get('ratio_sdpa_gather_vs_baseline', float('nan')):>8.3f}x "
            f"{r.get('ratio_cudnn_paged_vs_baseline', float('nan')):>7.3f}x"
        )


def print_repeated(results: list[dict]) -> None:
    rows = [r for r in results if "repeated" in r]
    if not rows:
        return
    print(f"\nrepeated ({rows[0]['repeated']['repeats']}x each, interleaved): median TFLOP/s and x baseline [min, max]")
    for r in rows:
        rep = r["repeated"]
        parts = [f"baseline {rep['baseline']['tflops_median']:.0f}"]
        for name in ("sdpa_gather", "cudnn_paged", "best_flash"):
            if name in rep:
                lo, hi = rep[name]["x_baseline_range"]
                parts.append(
                    f"{name} {rep[name]['tflops_median']:.0f} {rep[name]['x_baseline']:.3f}x [{lo:.3f}, {hi:.3f}]"
                )
        if "best_fp8" in rep:
            parts.append(
                f"fp8 {rep['best_fp8']['tflops_median']:.0f} = {rep['best_fp8'].get('x_best_flash', 0):.2f}x flash"
            )
        print(f"S={r['seq_len']} page={r['page_size']}: " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
