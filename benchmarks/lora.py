"""LoRA per request (issue 27): transformer step time with adapters against the base step, recompiles while
switching and mixing adapters, and adapter load time.

    python benchmarks/lora.py --out DIR            # GPU: FLUX.1-dev's transformer, random bf16 weights, 1024x1024
    python benchmarks/lora.py --smoke --out DIR    # the tiny FLUX transformer on the CPU (checks the script)

The transformer is diffusers' ``FluxTransformer2DModel`` with omni's attention processor, as ``omni-server``
serves it; the adapters are PEFT LoRAs of rank ``--rank`` (64) on every attention and MLP linear, written with
diffusers' ``save_lora_weights`` and read back through ``omni_models.lora_files`` (the server's path). Measured in
one run, each against its baseline:

- ``one_adapter``: batch 1, its row on adapter A, vs the base transformer (no LoRA hooks) at batch 1: <= 1.10x;
- ``four_adapters``: batch 4, rows on A, B, C, D (four slots), vs the base at batch 4: <= 1.15x;
- ``no_adapter``: LoRA on, no row with an adapter (what the hooks cost alone), batch 1;
- ``compiled`` (``--modes``; first by default, as it is what ``omni-server`` serves on CUDA): the same with every
  block compiled as serving compiles it (``omni_models.compilation.compile_modules`` with the default
  ``CompileSettings``: inductor, dynamic shapes), and the graphs dynamo compiles while the rows switch between
  adapters and mixes: 0 once warm. The LoRA delta is traced into the blocks' graphs on the row path
  (``LoRARuntime.compiled_path = "torch"``, the default: one copy of every row's adapter per forward, a batched
  expand per linear and one shrink per input, Q/K/V and FLUX's single-stream MLP sharing theirs);
  ``compiled_reference`` traces the per-linear gather of the slot weights instead (``"reference"``, the default of
  2026-12-02f, 1.157x for one adapter), ``compiled_kernels`` puts the Triton pair in the graph as one opaque op
  (``"kernels"``, 1.46x in 2026-12-02e). A forward without an adapter runs the graphs without the LoRA ops (the
  base's). The LoRA hooks are installed before the blocks compile (as ``omni_models.load`` does), and the base is the
  forward outside ``runtime.rows()``: dynamo does not guard on module hooks, so hooks added after the first compiled
  call never run (the 2026-12-02c run measured exactly that, see RESULTS.md); ``adapter_relative_change_of_output``
  (> 0, equal across modes) shows that the adapter reached the output;
- LoRA applies to the linears the four adapters hold (``LoRARuntime.restrict``: omni-server's default for a fixed
  set of ``--lora-modules``); ``--all-linear`` keeps every linear (a server that loads adapters at run time);
- ``--repeats N``: N runs of the batch-1 and batch-4 ratios once warm, each base timed just before its LoRA case;
  the median and [min, max] of the run ratios are what RESULTS.md quotes;
- adapter load: ``LoRARuntime.register`` (read, convert, check, host copy; the files' pages are dropped from the
  page cache first, so the read is from the disk) and the first slot fill (host to device).

Every figure is ``--iters`` timed forwards (each one repeat) after a warm-up: median and [min, max]. Each mode
builds a fresh transformer (same seed) and ``lora.json`` is rewritten after each mode, so a run cut by its time
limit keeps the modes it finished; ``--deadline`` skips the modes that would start after it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This directory holds scripts named like the packages (fp8_cache.py, ...): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
    "proj_out",
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, *, warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    ms = [1e3 * t for t in times]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "iters": iters, "ms": ms}


def build_transformer(smoke: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from omni_models import synthetic
    from omni_models.family_attention import OmniFluxAttnProcessor

    config: dict[str, Any] = {"guidance_embeds": True}
    if smoke:
        config.update(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        )
    transformer = synthetic.random_parameters(
        synthetic._make("diffusers", "FluxTransformer2DModel", **config), device=device, dtype=dtype
    )
    transformer.set_attn_processor(OmniFluxAttnProcessor())
    return transformer.requires_grad_(False)


def inputs(transformer: torch.nn.Module, batch: int, image_tokens: int, text_tokens: int, device, dtype):
    config = transformer.config
    side = int(image_tokens**0.5)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    generator = torch.Generator("cpu").manual_seed(batch)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    return dict(
        hidden_states=randn(batch, image_tokens, config.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, config.joint_attention_dim),
        pooled_projections=randn(batch, config.pooled_projection_dim),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=torch.float32),
        img_ids=ids.reshape(-1, 3).to(device, dtype),
        txt_ids=torch.zeros(text_tokens, 3, device=device, dtype=dtype),
        return_dict=False,
    )


def write_adapters(transformer, directory: Path, count: int, rank: int) -> list[Path]:
    from omni_models import synthetic

    files = []
    for i in range(count):
        state, config = synthetic.random_lora(
            transformer, rank=rank, target_modules=list(TARGETS), seed=i, std=0.01, dtype=torch.bfloat16
        )
        (directory / f"adapter-{i}").mkdir(parents=True, exist_ok=True)
        files.append(synthetic.save_lora("flux", directory / f"adapter-{i}", state, config))
        del state
    return files


def evict_from_page_cache(files: list[Path]) -> bool:
    """Write ``files`` out and drop their pages from the page cache (``posix_fadvise(DONTNEED)``), so that the next
    read comes from the disk; False where the OS has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_blocks(transformer: torch.nn.Module, backend: str) -> None:
    """Regional compilation as ``omni-server`` serves (``FamilyPipeline.compile``'s blocks, default settings but
    the backend)."""
    from omni_models.compilation import CompileSettings, compile_modules

    blocks = [
        b for path in ("transformer_blocks", "single_transformer_blocks") for b in transformer.get_submodule(path)
    ]
    compile_modules(blocks, CompileSettings(backend=backend))


def profile_forwards(path: Path, device: torch.device, *forwards) -> None:
    """torch.profiler's table (by device time, then host time) of one call of each of ``forwards``, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sections = []
    for index, fn in enumerate(forwards):
        synchronize(device)
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            fn()
            synchronize(device)
            wall_ms = 1e3 * (time.perf_counter() - start)
        sections.append(f"=== forward {index}: {wall_ms:.1f} ms wall under the profiler ===")
        shaped = prof.key_averages(group_by_input_shape=True)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        sections.append(
            f"=== forward {index} by device time and input shapes ===\n{shaped.table(sort_by=sort, row_limit=40)}"
        )
        table = prof.key_averages()
        sections.append(f"=== forward {index} by device time ===\n{table.table(sort_by=sort, row_limit=25)}")
        sections.append(
            f"=== forward {index} by host time ===\n{table.table(sort_by='self_cpu_time_total', row_limit=15)}"
        )
    path.write_text("\n".join(sections))


# FLUX.1-dev's target linears at 1024^2 (tokens, in, out): image-stream Q/K/V and the MLP of a double block, the
# text stream, and a single block's fused projection.
KERNEL_SHAPES = ((4096, 3072, 3072), (4096, 3072, 12288), (4096, 12288, 3072), (512, 3072, 3072), (4608, 15360, 3072))


def kernel_check(device: torch.device, dtype: torch.dtype, rank: int) -> list[dict[str, Any]]:
    """The Triton kernels on the GPU against the torch reference (fresh random inputs, rows on 4 slots and none)
    and their time beside the base linear's, per FLUX.1-dev target shape (``triton.testing.do_bench`` medians)."""
    from triton.testing import do_bench

    from omni_models.lora import LoRARows, lora_add

    rows_of = {
        1: LoRARows(torch.tensor([0], dtype=torch.int32, device=device), torch.ones(1, device=device)),
        4: LoRARows(
            torch.tensor([0, 3, -1, 1], dtype=torch.int32, device=device),
            torch.tensor([1.0, 0.5, 1.0, 1.0], device=device),
        ),
    }
    report = []
    for tokens, in_features, out_features in KERNEL_SHAPES:
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5
        down = torch.randn(4, rank, in_features, device=device, dtype=dtype) * in_features**-0.5
        up = torch.randn(4, out_features, rank, device=device, dtype=dtype) * rank**-0.5
        scaling = torch.tensor([1.0, 0.5, 2.0, 1.0], device=device)
        for batch, rows in rows_of.items():
            x = torch.randn(batch, tokens, in_features, device=device, dtype=dtype)
            y = torch.nn.functional.linear(x, weight)
            kernel = lora_add(y.clone(), x, down, up, scaling, rows, triton=True)  # in place, on a copy
            reference = lora_add(
                y.clone().double(), x.double(), down.double(), up.double(), scaling, rows, triton=False
            )
            delta_ref = (reference - y.double()).flatten(1)
            delta = (kernel.double() - y.double()).flatten(1)
            error = float((delta - delta_ref).norm() / delta_ref.norm())
            # The torch reference in the same dtype, for scale: bf16 rounds y + delta alike.
            same_dtype = lora_add(y.clone(), x, down, up, scaling, rows, triton=False).double() - y.double()
            torch_error = float((same_dtype.flatten(1) - delta_ref).norm() / delta_ref.norm())
            untouched = all(torch.equal(kernel[i], y[i]) for i in range(batch) if int(rows.slots[i]) < 0)
            base_ms = do_bench(lambda x=x: torch.nn.functional.linear(x, weight), return_mode="median")
            lora_ms = do_bench(
                lambda x=x, y=y, rows=rows: lora_add(y, x, down, up, scaling, rows, triton=True), return_mode="median"
            )
            torch_ms = do_bench(
                lambda x=x, y=y, rows=rows: lora_add(y, x, down, up, scaling, rows, triton=False), return_mode="median"
            )
            report.append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    "in": in_features,
                    "out": out_features,
                    "delta_rel_error_vs_fp64": error,
                    "torch_same_dtype_rel_error_vs_fp64": torch_error,
                    "rows_without_adapter_untouched": untouched,
                    "base_linear_ms": base_ms,
                    "lora_triton_ms": lora_ms,
                    "lora_torch_ms": torch_ms,
                    "triton_over_base_linear": lora_ms / base_ms,
                }
            )
            print(
                f"kernel b{batch} {tokens}x{in_features}->{out_features}: "
                f"rel err {error:.2e} (torch {torch_error:.2e}), "
                f"untouched {untouched}, "
                f"linear {base_ms:.3f} ms, LoRA triton {lora_ms:.3f} ms ({lora_ms / base_ms:.3f}x), "
                f"torch {torch_ms:.3f} ms",
                flush=True,
            )
    return report


# The row path's matmuls at FLUX.1-dev 1024^2, batch 1 (tokens, in, shrink width, out): a single block's shared
# shrink (MLP + Q/K/V) and its output projection, a double block's image Q/K/V, output and MLP, the text stream's.
GEMM_SHAPES = (
    (4608, 3072, 256, 12288),
    (4608, 15360, 64, 3072),
    (4096, 3072, 192, 3072),
    (4096, 3072, 64, 12288),
    (4096, 12288, 64, 3072),
    (512, 3072, 192, 3072),
    (512, 12288, 64, 3072),
)


def gemm_variants(device: torch.device, dtype: torch.dtype, rank: int) -> list[dict[str, Any]]:
    """Device time of the row path's matmuls and of alternatives, per shape (``do_bench`` medians, ms): the base
    linear; the shrink as served (``bmm`` against ``A^T``), as a 2-D ``mm``, split along ``in`` in 4; the base linear
    with the shrink's A rows appended to its weight (one GEMM for both); the expand and add as served, and as one
    ``addmm`` into the base output."""
    from triton.testing import do_bench

    report = []
    for tokens, in_features, width, out_features in GEMM_SHAPES:
        x = torch.randn(1, tokens, in_features, device=device, dtype=dtype)
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5
        down = torch.randn(1, width, in_features, device=device, dtype=dtype) * in_features**-0.5
        up = torch.randn(1, out_features, rank, device=device, dtype=dtype)
        joined = torch.cat([weight, down[0]])
        y = torch.nn.functional.linear(x, weight)
        shrunk = torch.bmm(x, down.transpose(1, 2))[..., :rank]
        chunks = x.view(tokens, 4, in_features // 4).transpose(0, 1)
        down_chunks = down[0].view(width, 4, in_features // 4).permute(1, 2, 0)
        cases = {
            "base_linear": lambda: torch.nn.functional.linear(x, weight),
            "shrink_bmm": lambda: torch.bmm(x, down.transpose(1, 2)),
            "shrink_mm": lambda: torch.mm(x[0], down[0].t()),
            "shrink_split4": lambda: torch.bmm(chunks, down_chunks).sum(0),
            "base_with_shrink_rows": lambda: torch.nn.functional.linear(x, joined),
            "expand_bmm_add": lambda: y + torch.bmm(shrunk, up.transpose(1, 2)),
            "expand_addmm": lambda: torch.addmm(y[0], shrunk[0], up[0].t()),
        }
        row = {"tokens": tokens, "in": in_features, "width": width, "out": out_features}
        row.update({name: do_bench(fn, return_mode="median") for name, fn in cases.items()})
        report.append(row)
        print("gemm " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return report


def run_figures(base_ms: float, lora_ms: float) -> dict[str, float]:
    """One run's base and LoRA medians and their ratio."""
    return {"base_ms": base_ms, "lora_ms": lora_ms, "ratio": lora_ms / base_ms}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny transformer, fp32, 16 image tokens (CPU)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--image-tokens", type=int, default=4096, help="1024x1024 in FLUX.1's 2x2-packed tokens")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10, help="timed forwards per figure (each one repeat)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="more runs of the batch-1 and batch-4 figures once warm, each base timed beside its LoRA case "
        "(median of --iters each): the ratios' median and [min, max] over the runs",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("compiled", "compiled_reference", "compiled_kernels", "eager"),
        default=["compiled", "eager"],
    )
    parser.add_argument(
        "--profile", action="store_true", help="per mode: torch.profiler's top ops of one base and one adapter forward"
    )
    parser.add_argument("--adapter-dir", type=Path, default=None, help="where the adapters are written (OUT/adapters)")
    parser.add_argument("--kernel-check", action=argparse.BooleanOptionalAction, default=True, help="CUDA only")
    parser.add_argument(
        "--all-linear",
        action="store_true",
        help="LoRA on every linear (a server that loads adapters at run time), not only the adapters' own "
        "(omni-server's default for --lora-modules)",
    )
    parser.add_argument("--gemm-variants", action="store_true", help="CUDA only: time the row path's matmuls")
    parser.add_argument("--deadline", type=float, default=None, help="seconds: start no mode after this")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.image_tokens, args.text_tokens, args.iters, args.rank = 16, 16, 3, 8
    args.out.mkdir(parents=True, exist_ok=True)
    from omni_models.backends.flux import FAMILY
    from omni_models.lora import LoRAOptions, LoRARuntime, lora_targets, padded_rank
    from omni_models.lora_files import read_lora

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rank": args.rank,
        "image_tokens": args.image_tokens,
        "text_tokens": args.text_tokens,
        "dtype": str(dtype),
    }

    def log(message: str) -> None:
        print(message, flush=True)

    if device.type == "cuda" and args.kernel_check:
        try:
            results["kernels"] = kernel_check(device, dtype, padded_rank(args.rank))
        except Exception as error:  # noqa: BLE001 - the step figures below still count; the JSON says what broke
            results["kernels"] = {"error": repr(error)}
            log(f"kernel check failed: {error!r}")
        (args.out / "lora.json").write_text(json.dumps(results, indent=1) + "\n")
    if device.type == "cuda" and args.gemm_variants:
        results["gemm_variants"] = gemm_variants(device, dtype, padded_rank(args.rank))
        (args.out / "lora.json").write_text(json.dumps(results, indent=1) + "\n")
    transformer = build_transformer(args.smoke, device, dtype)
    start = time.perf_counter()
    files = write_adapters(transformer, args.adapter_dir or args.out / "adapters", 4, args.rank)
    results["adapters_written_s"] = time.perf_counter() - start
    results["adapter_file_mb"] = files[0].stat().st_size / 2**20
    batches = {b: inputs(transformer, b, args.image_tokens, args.text_tokens, device, dtype) for b in (1, 4)}
    warmup = 2 if args.smoke else 3
    log(f"adapters written ({results['adapter_file_mb']:.0f} MB each) at {time.perf_counter() - started:.0f} s")

    def forward(batch: int):
        return lambda: transformer(**batches[batch])

    for mode in args.modes:
        if args.deadline is not None and time.perf_counter() - started > args.deadline:
            results[mode] = {"skipped": f"past --deadline {args.deadline} s"}
            log(f"{mode}: skipped (past the deadline)")
            continue
        if mode != args.modes[0]:  # a fresh transformer, same seed: nothing compiled or hooked from the last mode
            del transformer
            torch.cuda.empty_cache() if device.type == "cuda" else None
            transformer = build_transformer(args.smoke, device, dtype)
        torch._dynamo.reset()
        graphs_at_start = unique_graphs()
        mode_start = time.perf_counter()
        with torch.no_grad():

            def measure_base() -> tuple[dict[int, Any], dict[int, float]]:
                base, first_call_s = {}, {}
                for b in (1, 4):
                    start = time.perf_counter()
                    forward(b)()
                    synchronize(device)
                    first_call_s[b] = time.perf_counter() - start
                    base[b] = timed(forward(b), device, warmup=warmup, iters=args.iters)
                return base, first_call_s

            if mode == "eager":  # the base without any hook (eager runs hooks added later)
                base, first_call_s = measure_base()
            targets = {n: (m.in_features, m.out_features) for n, m in lora_targets(transformer).items()}
            # The hooks exist before anything compiles, as omni_models.load orders it: dynamo does not guard on
            # module hooks (torch._dynamo.config.skip_nnmodule_hook_guards), so hooks added after a block's first
            # compiled call would silently never run.
            runtime = LoRARuntime(
                transformer,
                lambda path: read_lora(FAMILY, path, targets, max_rank=args.rank, dtype=dtype),
                LoRAOptions(max_loras=4, max_rank=args.rank),
                device=device,
                dtype=dtype,
                compiled_path={"compiled_kernels": "kernels", "compiled_reference": "reference"}.get(mode, "torch"),
            )
            results["adapter_reads_from_disk"] = evict_from_page_cache(files)
            adapters = []
            for i, file in enumerate(files):
                adapters.append(runtime.register(f"adapter-{i}", file))
            loads = {"register_s": [a.load_s for a in adapters]}
            if not args.all_linear:  # omni-server's default for a fixed set of adapters (--lora-modules)
                runtime.restrict(sorted(runtime.registered_layers()))
            results["lora_targets"] = {"linears": len(runtime.linears), "targets": len(runtime.targets)}
            if mode.startswith("compiled"):
                runtime.compiled = True  # as FamilyPipeline.compile sets it
                compile_blocks(transformer, "eager" if args.smoke else "inductor")  # smoke: dynamo only, no C++
                # The base: forwards outside ``runtime.rows()``, where every hook returns the linear's output
                # as it is, which dynamo traces away (the graph of a transformer without LoRA).
                base, first_call_s = measure_base()
            base_graphs = unique_graphs() - graphs_at_start
            fill = []
            for adapter in adapters:
                start = time.perf_counter()
                with runtime.rows([adapter], [1.0]):
                    pass
                synchronize(device)
                fill.append(time.perf_counter() - start)
            loads["first_slot_fill_s"] = fill

            def with_rows(batch: int, rows: list):
                def run():
                    with runtime.rows(rows, [1.0] * len(rows)):
                        transformer(**batches[batch])

                return run

            a, b, c, d = adapters
            graphs_before = unique_graphs()
            cases = {
                "one_adapter": (1, [a]),
                "no_adapter": (1, [None]),
                "four_adapters": (4, [a, b, c, d]),
                "one_adapter_x4": (4, [a, a, a, a]),
            }
            timings = {
                name: timed(with_rows(bs, rows), device, warmup=warmup, iters=args.iters)
                for name, (bs, rows) in cases.items()
            }
            warm_graphs = unique_graphs()
            warm_s = time.perf_counter() - mode_start
            repeats = []  # interleaved: each run times the base next to its LoRA case, so drift hits both alike
            for _ in range(args.repeats - 1):
                run = {}
                for key, bs, rows in (("one_adapter", 1, [a]), ("four_adapters", 4, [a, b, c, d])):
                    base_run = timed(forward(bs), device, warmup=1, iters=args.iters)["median_ms"]
                    lora_run = timed(with_rows(bs, rows), device, warmup=1, iters=args.iters)["median_ms"]
                    run[key] = run_figures(base_run, lora_run)
                repeats.append(run)
            # The adapter reaches the output: its relative change of the batch-1 output (the same transformer seed,
            # adapters and inputs in every mode, so the modes' figures should agree; 0 would mean not applied).
            base_out = transformer(**batches[1])[0].float()
            with runtime.rows([a], [1.0]):
                lora_out = transformer(**batches[1])[0].float()
            adapter_change = float((lora_out - base_out).norm() / base_out.norm())
            del base_out, lora_out
            if args.profile:
                profile_forwards(args.out / f"profile_{mode}.txt", device, forward(1), with_rows(1, [a]))
            # Switching and mixing once everything is warm: every row table a new tensor, slots rewritten in place.
            for rows in ([b], [None], [c], [d], [a, None, b, c], [d, d, None, a], [None] * 4):
                with_rows(len(rows), rows)()
            synchronize(device)
            recompiles = unique_graphs() - warm_graphs
            runtime.close()
        first_run = {
            key: run_figures(base[bs]["median_ms"], timings[key]["median_ms"])
            for key, bs in (("one_adapter", 1), ("four_adapters", 4))
        }
        runs = [first_run, *repeats]
        over_runs = {
            key: {
                "median": statistics.median(r[key]["ratio"] for r in runs),
                "min": min(r[key]["ratio"] for r in runs),
                "max": max(r[key]["ratio"] for r in runs),
                "runs": len(runs),
            }
            for key in ("one_adapter", "four_adapters")
        }
        results[mode] = {
            "runs": runs,
            "ratios_over_runs": over_runs,
            "base": base,
            "first_call_s": first_call_s,
            "base_graphs": base_graphs,
            "mode_s_until_warm": warm_s,
            **timings,
            "ratios": {
                "one_adapter_vs_base": timings["one_adapter"]["median_ms"] / base[1]["median_ms"],
                "no_adapter_vs_base": timings["no_adapter"]["median_ms"] / base[1]["median_ms"],
                "four_adapters_vs_base": timings["four_adapters"]["median_ms"] / base[4]["median_ms"],
                "one_adapter_x4_vs_base": timings["one_adapter_x4"]["median_ms"] / base[4]["median_ms"],
            },
            "graphs_compiled_while_warming": warm_graphs - graphs_before,
            "adapter_relative_change_of_output": adapter_change,
            "graphs_compiled_by_switches": recompiles,
            "loads": loads,
            "slot_mb": sum(s.nbytes for s in runtime.targets.values()) / 2**20,
            "spread_ms": {
                name: [t["min_ms"], t["max_ms"]]
                for name, t in {"base_1": base[1], "base_4": base[4], **timings}.items()
            },
        }
        r = results[mode]["ratios"]
        log(
            f"{mode}: base {base[1]['median_ms']:.2f} ms (batch 1), {base[4]['median_ms']:.2f} ms (batch 4); "
            f"one adapter {r['one_adapter_vs_base']:.3f}x (target <= 1.10), four adapters "
            f"{r['four_adapters_vs_base']:.3f}x (target <= 1.15), no adapter {r['no_adapter_vs_base']:.3f}x; "
            f"graphs compiled by switches: {recompiles} (target 0); adapter changes the output by "
            f"{adapter_change:.2e} (relative; 0 = not applied); "
            f"register {statistics.mean(loads['register_s']):.3f} s,"
            f" slot fill {statistics.mean(fill[1:] or fill):.4f} s per adapter;"
            f" mode took {time.perf_counter() - mode_start:.0f} s"
        )
        if len(runs) > 1:
            log(
                f"{mode} over {len(runs)} runs: "
                + "; ".join(
                    f"{key} median {v['median']:.3f}x [{v['min']:.3f}, {v['max']:.3f}]" for key, v in over_runs.items()
                )
            )
        results["total_s"] = time.perf_counter() - started
        (args.out / "lora.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
