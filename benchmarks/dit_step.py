"""One image denoising step of the large causal-prefix DiT: today's eager path vs fused ops + CUDA graphs, bf16 and FP8.

The ~2.2 B `large` config (width 2048, 28 blocks, 16 heads x 128), random bf16 weights built on the device, one
CFG job (2 rows, 512 prompt tokens each, 1024 image tokens at 64x64), paged K/V in blocks of 64, prefix K/V
written once. A "step" is `omni_models.paged.denoise_step` (both rows in one forward, target tokens only).

Modes, all measured in this run and in this order:
- `eager_unfused`: today's path: `set_fused_ops(False)` (per-token gathers of the modulation rows, separate
  LayerNorm/scale/shift/gate ops, float32 QK norms), no graphs: the baseline;
- `eager_fused`: the fused indexed ops of `omni_models.fused`, no graphs;
- `graphs_unfused`, `graphs_fused`: the same with the step replayed as a CUDA graph (`omni_models.graphs`);
- after `omni_models.integrations.quantize_fp8`: `fp8_eager_unfused` (FP8Linear quantizing its own input,
  per tensor), `fp8_graphs_fused` (the fused ops write the FP8 input of qkv/fc1/fc2), and
  `fp8_graphs_fused_rowwise` (also the attention projection quantized per row in one pass).
Per mode: median step time over `--steps` timed steps (CUDA events, after warm-up steps, the first of which
captures the graph), TFLOP/s from counted FLOPs (linears + attention, as benchmarks/prefix_reuse.py counts them).
Correctness: the latents after 3 steps of every mode against `eager_unfused` in the same precision (relative L2),
and graph replay against eager (same kernels: bitwise equal expected).

Then: a `torch.profiler` summary of one step before (`eager_unfused`) and after (`graphs_fused`, and
`eager_fused` whose kernels are the same but visible one by one), written as tables and a "where the time goes"
JSON by kernel category; and prefix K/V reuse vs recompute over `--reuse-repeats` whole images (30 steps), in
the eager baseline and in the graphs + fused path, median and spread against the FLOP-derived ideal saving.

    PYTHONPATH=packages/diffusion-kv/src:packages/fp8-cache/src:packages/models/src \\
        python benchmarks/dit_step.py --out OUT
    python benchmarks/dit_step.py --smoke        # tiny model on the CPU (no graphs, FP8 by the fallback path)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

# benchmarks/fp8_cache.py would shadow the fp8_cache package: drop this script's directory from the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from omni_models.config import DiTConfig, large_config  # noqa: E402
from omni_models.graphs import StepGraphs  # noqa: E402
from omni_models.integrations import quantize_fp8  # noqa: E402
from omni_models.model import CausalPrefixDiT  # noqa: E402
from omni_models.pipeline import Pipeline  # noqa: E402
from omni_models.runner import GenerationJob  # noqa: E402
from omni_models.tokenizer import BOS_TOKEN, PAD_TOKEN, Tokenizer  # noqa: E402

_spec = importlib.util.spec_from_file_location("prefix_reuse_benchmark", _HERE / "prefix_reuse.py")
_prefix_reuse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_prefix_reuse)
layer_flops, make_job = _prefix_reuse.layer_flops, _prefix_reuse.make_job

# Kernel-name fragments -> category of the "where the time goes" table (first match wins; lower case).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("paged_attention", "paged_flash", "flash", "fmha", "attn")),
    ("kv cache write", ("write_kv",)),
    ("fused norm/modulation", ("layer_norm_modulate", "gated_residual", "rms_norm_heads", "gelu_quantize")),
    ("fp8 activation quantization", ("amax_kernel", "scale_and_cast", "quantize_rows")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "scaled_mm", "cublas", "matmul", "sm90_", "f8f8bf16")),
    ("layernorm (torch)", ("layer_norm",)),
    (
        "gather/elementwise/reduce (torch)",
        (
            "elementwise",
            "index",
            "gather",
            "reduce",
            "copy",
            "cat",
            "fill",
            "gelu",
            "pow",
            "mean",
            "rsqrt",
            "mul",
            "add",
            "silu",
        ),
    ),
)


def categorize(name: str) -> str:
    lowered = name.lower()
    for category, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return category
    return "other"


class StepBench:
    """One job on a pool of exactly its rows (a pipeline's private pool); every mode runs a fresh copy of the job."""

    def __init__(
        self,
        model: CausalPrefixDiT,
        config: DiTConfig,
        *,
        prompt_tokens: int,
        image_size: int,
        block_size: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model, self.device = model, device
        # Token ids come from make_job directly; the tokenizer is never asked to encode.
        self.pipe = Pipeline(
            model, Tokenizer((PAD_TOKEN, BOS_TOKEN), max_tokens=config.max_prompt_tokens), device=device, dtype=dtype
        )
        self.template = make_job(config, prompt_tokens, image_size, image_size, steps, seed=1)
        self.pipe.allocate_kv_caches_for([self.template], block_size)
        self.identities = self.template.kv_rows
        self.rows = len(self.template.rows)
        prefix_flops, target_flops = layer_flops(config, prompt_tokens, self.template.rows[0].target_len)
        self.step_flops = self.rows * target_flops
        self.prefix_flops = self.rows * prefix_flops

    def fresh_batch(self, fused_ops: bool, graphs: StepGraphs | None) -> list[GenerationJob]:
        """A copy of the job on the pool's rows, with the mode's fused ops and graphs selected."""
        self.model.set_fused_ops(fused_ops)
        self.pipe.step_graphs = graphs
        t = self.template
        return [
            GenerationJob(
                request=t.request,
                rows=t.rows,
                latents=t.latents.to(self.device),
                times=t.times,
                kv_rows=self.identities,
            )
        ]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, fused_ops: bool, graphs: StepGraphs | None, *, warmup: int, timed: int) -> dict:
        """Median step time of `timed` steps after `warmup` steps (the prefix is written first, untimed)."""
        batch = self.fresh_batch(fused_ops, graphs)
        self.pipe.start(batch)
        for _ in range(warmup):
            self.pipe.step(batch)
        times = [self._timed(lambda: self.pipe.step(batch)) for _ in range(timed)]
        median = statistics.median(times)
        return {
            "step_ms": median,
            "min_ms": min(times),
            "max_ms": max(times),
            "steps": timed,
            "tflops": self.step_flops / median / 1e9,
        }

    def _timed(self, fn) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def latents_after(self, fused_ops: bool, graphs: StepGraphs | None, steps: int = 3) -> torch.Tensor:
        batch = self.fresh_batch(fused_ops, graphs)
        self.pipe.start(batch)
        for _ in range(steps):
            self.pipe.step(batch)
        return batch[0].latents.float().clone()

    def image(self, fused_ops: bool, graphs: StepGraphs | None, *, reuse: bool) -> float:
        """Seconds for one whole image (all steps; reuse writes the prefix once, recompute every step)."""
        batch = self.fresh_batch(fused_ops, graphs)

        def generate():
            if reuse:
                self.pipe.start(batch)
            for _ in range(batch[0].num_steps):
                self.pipe.step(batch, recompute_prefix=not reuse)

        return self._timed(generate) / 1e3


def profile_step(bench: StepBench, fused_ops: bool, graphs: StepGraphs | None, out: Path | None, label: str) -> dict:
    """torch.profiler over one step (after warm-up): kernel time by category, and the top-30 table to a file."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    batch = bench.fresh_batch(fused_ops, graphs)
    bench.pipe.start(batch)
    for _ in range(2):
        bench.pipe.step(batch)
    bench.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        bench.pipe.step(batch)
        bench.sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    by_category: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "kernels": 0})
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    for event in kernels:
        entry = by_category[categorize(event.name)]
        entry["us"] += event.self_device_time_total
        entry["kernels"] += 1
    busy_us = sum(entry["us"] for entry in by_category.values())
    summary = {
        "label": label,
        "wall_ms_under_profiler": wall_ms,
        "kernel_ms": busy_us / 1e3,
        "kernel_launches": len(kernels),
        "categories": {
            name: {"ms": v["us"] / 1e3, "share": v["us"] / busy_us if busy_us else 0.0, "kernels": v["kernels"]}
            for name, v in sorted(by_category.items(), key=lambda kv: -kv[1]["us"])
        },
    }
    sort_key = "self_cuda_time_total" if bench.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=30, max_name_column_width=70)
    if out is not None:
        (out / f"profile_{label}.txt").write_text(
            f"# one denoise step, {label}; wall {wall_ms:.2f} ms under the profiler, kernels {busy_us / 1e3:.2f} ms "
            f"in {len(kernels)} launches\n{table}\n"
        )
    return summary


def prefix_reuse(bench: StepBench, fused_ops: bool, graphs_factory, repeats: int, steps: int) -> dict:
    """Whole images with prefix reuse vs recompute (warm-up image first), median and spread of the saving."""
    results = {}
    for reuse in (True, False):
        graphs = graphs_factory()
        bench.image(fused_ops, graphs, reuse=reuse)  # warm-up (and captures)
        results["reuse" if reuse else "recompute"] = [
            bench.image(fused_ops, graphs, reuse=reuse) for _ in range(repeats)
        ]
    flops_reuse = bench.prefix_flops + steps * bench.step_flops
    flops_recompute = steps * (bench.prefix_flops + bench.step_flops)
    ideal = 1 - flops_reuse / flops_recompute
    # Pair the i-th reuse with the i-th recompute image for the spread of the fraction.
    fractions = [(1 - a / b) / ideal for a, b in zip(results["reuse"], results["recompute"], strict=True)]
    t_reuse, t_recompute = statistics.median(results["reuse"]), statistics.median(results["recompute"])
    return {
        "reuse_s": results["reuse"],
        "recompute_s": results["recompute"],
        "median_reuse_s": t_reuse,
        "median_recompute_s": t_recompute,
        "ideal_saving": ideal,
        "median_saving": 1 - t_reuse / t_recompute,
        "fraction_of_ideal_median": (1 - t_reuse / t_recompute) / ideal,
        "fraction_of_ideal_per_pair": fractions,
        "fraction_of_ideal_min": min(fractions),
        "fraction_of_ideal_max": max(fractions),
        "tflops_reuse": flops_reuse / t_reuse / 1e12,
        "tflops_recompute": flops_recompute / t_recompute / 1e12,
    }


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for dit_step.json and profile tables")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (the first captures)")
    parser.add_argument("--reuse-repeats", type=int, default=5, help="images per prefix-reuse mode")
    parser.add_argument("--image-steps", type=int, default=30, help="denoising steps of one image")
    parser.add_argument("--skip-fp8", action="store_true")
    parser.add_argument("--skip-reuse", action="store_true")
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        config = DiTConfig(
            name="smoke",
            width=64,
            depth=2,
            num_heads=2,
            patch_size=2,
            vocab_size=64,
            max_prompt_tokens=16,
            supported_sizes=((8, 8),),
        )
        prompt_tokens, image_size, block_size = 12, 8, 16
        args.steps, args.warmup, args.reuse_repeats, args.image_steps = 2, 1, 2, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("dit_step needs a CUDA device (use --smoke on CPU)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = large_config()
        prompt_tokens, image_size, block_size = 512, 64, 64
    use_graphs = device.type == "cuda"

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = CausalPrefixDiT(config)
        for block in model.blocks:  # non-zero adaLN and output weights: the image path depends on every layer
            torch.nn.init.normal_(block.modulation.weight, std=0.02)
        torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    model.to(dtype).eval()
    setup_s = time.perf_counter() - t0
    bench = StepBench(
        model,
        config,
        prompt_tokens=prompt_tokens,
        image_size=image_size,
        block_size=block_size,
        steps=max(args.image_steps, args.warmup + args.steps + 1),
        device=device,
        dtype=dtype,
    )
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "config": config.to_dict(),
        "dtype": str(dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompt_tokens": prompt_tokens,
        "image_tokens": bench.template.rows[0].target_len,
        "rows": bench.rows,
        "block_size": block_size,
        "step_tflop": bench.step_flops / 1e12,
        "setup_s": setup_s,
        "modes": {},
        "checks": {},
    }

    def graphs():
        return StepGraphs() if use_graphs else None

    modes = [("eager_unfused", False, False), ("eager_fused", True, False)]
    if use_graphs:
        modes += [("graphs_unfused", False, True), ("graphs_fused", True, True)]
    image_steps = bench.template.num_steps
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def measure(name: str, fused_ops: bool, graphed: bool, reference: torch.Tensor, label: str) -> torch.Tensor:
        result["modes"][name] = bench.run(
            fused_ops, graphs() if graphed else None, warmup=args.warmup, timed=args.steps
        )
        latents = bench.latents_after(fused_ops, graphs() if graphed else None)
        result["checks"][f"{name}_latents_rel_l2_vs_{label}"] = rel_l2(latents, reference)
        if graphed:
            eager = bench.latents_after(fused_ops, None)
            result["checks"][f"{name}_bitwise_equal_to_eager"] = bool(torch.equal(latents, eager))
        print(
            f"{name:<28}{result['modes'][name]['step_ms']:>9.2f} ms {result['modes'][name]['tflops']:>8.1f} TFLOP/s",
            flush=True,
        )
        return latents

    result["errors"] = {}

    def section(name: str, fn) -> None:
        """Run one part; a failure is recorded (and printed) instead of losing the parts already measured."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and the output
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"section {name} failed: {result['errors'][name]}", flush=True)

    def bf16_modes():
        for name, fused_ops, graphed in modes:
            section(
                name,
                lambda name=name, fused_ops=fused_ops, graphed=graphed: measure(
                    name, fused_ops, graphed, bf16_reference, "eager_unfused"
                ),
            )

    def profiles():
        result["profiles"] = {
            "before": profile_step(bench, False, None, out, "before_eager_unfused"),
            "after_fused_eager": profile_step(bench, True, None, out, "after_fused_eager"),
        }
        if use_graphs:
            result["profiles"]["after"] = profile_step(bench, True, graphs(), out, "after_graphs_fused")

    def reuse():
        result["prefix_reuse"] = {
            "eager_unfused": prefix_reuse(bench, False, lambda: None, args.reuse_repeats, image_steps)
        }
        if use_graphs:
            result["prefix_reuse"]["graphs_fused"] = prefix_reuse(bench, True, graphs, args.reuse_repeats, image_steps)

    def fp8_part():
        from fp8_cache import FP8Linear

        result["fp8_quantized_linears"] = len(quantize_fp8(model).quantized)
        fp8_linears = [module for module in model.modules() if isinstance(module, FP8Linear)]

        def scale_activations(scaling: str) -> None:  # each FP8Linear keeps the scaling it was quantized with
            for linear in fp8_linears:
                linear.activation_scaling = scaling

        fp8_modes = [("fp8_eager_unfused", False, False, "tensor")]
        if use_graphs:
            fp8_modes += [("fp8_graphs_fused", True, True, "tensor"), ("fp8_graphs_fused_rowwise", True, True, "row")]
        with torch.inference_mode():
            fp8_reference = bench.latents_after(False, None)
            result["checks"]["fp8_eager_unfused_latents_rel_l2_vs_bf16"] = rel_l2(fp8_reference, bf16_reference)
            for name, fused_ops, graphed, scaling in fp8_modes:
                scale_activations(scaling)

                def one(name=name, fused_ops=fused_ops, graphed=graphed):
                    latents = measure(name, fused_ops, graphed, fp8_reference, "fp8_eager_unfused")
                    result["checks"][f"{name}_latents_rel_l2_vs_bf16"] = rel_l2(latents, bf16_reference)

                section(name, one)
            if use_graphs:
                scale_activations("row")
                section(
                    "profile_fp8",
                    lambda: result["profiles"].__setitem__(
                        "after_fp8", profile_step(bench, True, graphs(), out, "after_fp8_graphs_fused")
                    ),
                )

    result["profiles"] = {}
    try:
        with torch.inference_mode():
            bf16_reference = bench.latents_after(False, None)
            bf16_modes()
            if not args.skip_reuse:
                section("prefix_reuse", reuse)
            section("profiles", profiles)
        if not args.skip_fp8:
            section("fp8", fp8_part)
    finally:
        report(result, bench, prompt_tokens, args.out)
    return result


def report(result: dict, bench: StepBench, prompt_tokens: int, out: Path | None) -> None:
    """Print the tables (the device call returns the end of the output) and write dit_step.json."""
    if out is not None:
        (out / "dit_step.json").write_text(json.dumps(result, indent=1))
    base = result["modes"].get("eager_unfused", {}).get("step_ms")
    for mode in result["modes"].values():
        mode["speedup_vs_eager_unfused"] = base / mode["step_ms"] if base else float("nan")
    print(
        f"\n# DiT step on {result['device']}: {result['parameters'] / 1e9:.2f} B params, {bench.rows} rows x "
        f"{result['image_tokens']} image tokens over {prompt_tokens} prompt tokens, {result['step_tflop']:.2f} "
        f"TFLOP per step"
    )
    print(f"{'mode':<28}{'step ms':>9}{'TFLOP/s':>9}{'x eager':>9}")
    for name, mode in result["modes"].items():
        print(f"{name:<28}{mode['step_ms']:>9.2f}{mode['tflops']:>9.1f}{mode['speedup_vs_eager_unfused']:>8.2f}x")
    for name, value in result["checks"].items():
        print(f"check {name}: {value}")
    for label, profile in result.get("profiles", {}).items():
        shares = ", ".join(f"{k} {v['ms']:.2f} ms ({v['share']:.0%})" for k, v in profile["categories"].items())
        print(
            f"profile {label}: kernels {profile['kernel_ms']:.2f} ms in {profile['kernel_launches']} launches; {shares}"
        )
    for label, reuse in result.get("prefix_reuse", {}).items():
        print(
            f"prefix reuse ({label}): median reuse {reuse['median_reuse_s']:.3f} s, recompute "
            f"{reuse['median_recompute_s']:.3f} s; saving {reuse['median_saving']:.1%} of ideal "
            f"{reuse['ideal_saving']:.1%} -> {reuse['fraction_of_ideal_median']:.1%} of ideal (pairs "
            f"{reuse['fraction_of_ideal_min']:.1%}..{reuse['fraction_of_ideal_max']:.1%})"
        )
    for name, error in result.get("errors", {}).items():
        print(f"ERROR in {name}: {error}")
    if out is not None:
        (out / "dit_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
