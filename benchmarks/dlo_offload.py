"""Layerwise offload on a DiT-like stack: overlap, H2D bandwidth, device memory; and AllGather across 2 GPUs.

The stack: ``--blocks`` (24) blocks of hidden ``--hidden`` (3072), bf16, 24 heads, each block LayerNorm ->
fused QKV -> SDPA -> out-projection -> LayerNorm -> 4x GELU MLP, with a per-block adaLN-single modulation
table (~113M parameters, ~226 MB per block, ~5.4 GB in all). Built on the GPU from a fixed seed, so every rank
and every mode holds identical weights.

``--mode single`` (one GPU; the default), all in one process and one run:
  (a) compute-bound, 8192 tokens (batch 1 and batch 2 = a CFG pair): offloaded / resident forward time
      (target <= 1.05x). The per-block compute and per-block pinned H2D times are printed too, so it is clear
      which regime each row is in.
  (b) transfer-bound, 512 tokens: bytes streamed per forward / offloaded forward time, against a plain pinned
      H2D copy of the same block buffers measured in the same run (target >= 90%).
  (c) device weight memory after enable against resident blocks + 2 slots, and the forward's peak.
  Outputs of the offloaded and resident model are compared (max abs difference; 0 expected).
  ``--checkpoint-stream`` adds rows for ``stream_from_checkpoint=True``: the blocks are saved as safetensors
  (in ``--scratch``), preflighted, and packed from the page-cache mapping into pinned staging per copy.

``--mode allgather`` (``torchrun --nproc-per-node 2``; NCCL on GPU, run with ``NCCL_NVLS_ENABLE=0``):
  per-block AllGather time and bandwidth (slot bytes / time), DP2 throughput of two concurrent requests
  (one per rank, AllGather offload) against two independent resident replicas (target >= 0.9x), and device
  weight memory per GPU against 2 slots.

Timing: CUDA events around ``--iters`` forwards after ``--warmup`` forwards (median of per-iteration times).
``--smoke`` runs tiny sizes on the CPU (gloo for allgather) to check the script end to end.

Usage (GPU):  python benchmarks/dlo_offload.py --out "$OUT"
              NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/dlo_offload.py --mode allgather --out "$OUT"
Smoke (CPU):  python benchmarks/dlo_offload.py --smoke
              torchrun --nproc-per-node 2 benchmarks/dlo_offload.py --mode allgather --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# This script is named like the package it measures; drop its own directory from the import path so that
# `import dlo_offload` finds the library, not this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dlo_offload import OffloadPlan, build_checkpoint_mmap_plan, enable_layerwise_offload  # noqa: E402


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.modulation = nn.Parameter(torch.randn(6, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + t_emb).unsqueeze(2).unbind(1)
        y = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(y).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + gate1 * self.out(a)
        y = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


class DiTStack(nn.Module):
    def __init__(self, hidden: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.time_embed = nn.Linear(hidden, 6 * hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads) for _ in range(blocks))
        self.final_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t_emb = self.time_embed(t).view(t.shape[0], 6, -1)
        for block in self.blocks:
            x = block(x, t_emb)
        return self.final_norm(x)


PLAN = OffloadPlan("blocks", resident_modules=("time_embed", "final_norm"))


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> DiTStack:
    torch.manual_seed(0)
    with torch.device(device):
        model = DiTStack(args.hidden, args.heads, args.blocks)
    return model.to(dtype).requires_grad_(False).eval()


def inputs(args: argparse.Namespace, tokens: int, batch: int, device: torch.device, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, tokens, args.hidden, generator=g, device=device, dtype=dtype)
    t = torch.randn(batch, args.hidden, generator=g, device=device, dtype=dtype)
    return x, t


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of `fn` in ms: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def pinned_h2d_ms(buffers: list[torch.Tensor], device: torch.device, warmup: int, iters: int) -> float:
    """A plain back-to-back copy of the same host buffers into one device buffer, on one side stream."""
    target = torch.empty(max(b.numel() for b in buffers), dtype=torch.uint8, device=device)
    if device.type != "cuda":
        return time_ms(lambda: [target[: b.numel()].copy_(b) for b in buffers], device, warmup, iters)
    stream = torch.cuda.Stream(device=device)

    def copy_all() -> None:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in buffers:
                target[: b.numel()].copy_(b, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(stream)

    return time_ms(copy_all, device, warmup, iters)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run_single(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "device": str(device)}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    cases = [
        ("compute_bound_b1", args.tokens, 1),
        ("compute_bound_b2", args.tokens, 2),
        ("transfer_bound", args.small_tokens, 1),
    ]
    model = build_model(args, device, dtype)
    resident_ms, expected = {}, {}
    with torch.inference_mode():
        for name, tokens, batch in cases:
            x, t = inputs(args, tokens, batch, device, dtype)
            resident_ms[name] = time_ms(lambda: model(x, t), device, args.warmup, args.iters)
            expected[name] = model(x, t).float().cpu()
    model.to("cpu")
    del x, t
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device)
    handle = enable_layerwise_offload(model, PLAN, device=device, pin_memory=True)
    weights = allocated(device) - before
    bound = handle.resident_nbytes + 2 * handle.slot_nbytes
    streamed_bytes = handle.host_nbytes
    block_h2d_ms = pinned_h2d_ms(handle.host_block_buffers, device, args.warmup, args.iters)
    pinned_gbs = streamed_bytes / (block_h2d_ms * 1e-3) / 1e9
    results["memory"] = {
        "weights_after_enable_bytes": weights,
        "resident_plus_two_slots_bytes": bound,
        "ratio": weights / bound if bound else None,
        "slot_bytes": handle.slot_nbytes,
        "resident_bytes": handle.resident_nbytes,
        "host_pinned": handle.pinned,
        "host_bytes": handle.host_nbytes,
        "model_bytes_resident_run": streamed_bytes + handle.resident_nbytes,
    }
    results["pinned_h2d"] = {
        "ms_all_blocks": block_h2d_ms,
        "gb_per_s": pinned_gbs,
        "ms_per_block": block_h2d_ms / max(1, len(handle.host_block_buffers)),
    }
    rows = []
    with torch.inference_mode():
        for name, tokens, batch in cases:
            x, t = inputs(args, tokens, batch, device, dtype)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = allocated(device)
            offload_ms = time_ms(lambda: model(x, t), device, args.warmup, args.iters)
            peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
            diff = (model(x, t).float().cpu() - expected[name]).abs().max().item()
            row = {
                "case": name,
                "tokens": tokens,
                "batch": batch,
                "resident_ms": resident_ms[name],
                "offload_ms": offload_ms,
                "ratio": offload_ms / resident_ms[name],
                "compute_ms_per_block": resident_ms[name] / args.blocks,
                "h2d_ms_per_block": results["pinned_h2d"]["ms_per_block"],
                "achieved_h2d_gb_per_s": streamed_bytes / (offload_ms * 1e-3) / 1e9,
                "achieved_vs_pinned": block_h2d_ms / offload_ms,
                "forward_peak_above_weights_bytes": peak,
                "max_abs_diff_vs_resident": diff,
            }
            rows.append(row)
    handle.remove()
    if args.checkpoint_stream:
        rows += checkpoint_stream_rows(args, model, device, dtype, cases, resident_ms, expected, block_h2d_ms)
    results["rows"] = rows

    print(
        f"dlo_offload single  device={results.get('device_name', device)}  blocks={args.blocks} hidden={args.hidden} "
        f"dtype={args.dtype}  block={handle.slot_nbytes / 2**20:.1f} MiB  pinned={handle.pinned}"
    )
    print(
        f"{'case':<30}{'tok':>6}{'B':>3}{'resident ms':>13}{'offload ms':>12}{'ratio':>8}"
        f"{'blk cmp ms':>12}{'blk h2d ms':>12}{'GB/s':>8}{'vs pinned':>11}{'diff':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<30}{r['tokens']:>6}{r['batch']:>3}{r['resident_ms']:>13.2f}{r['offload_ms']:>12.2f}"
            f"{r['ratio']:>8.3f}{r['compute_ms_per_block']:>12.3f}{r['h2d_ms_per_block']:>12.3f}"
            f"{r['achieved_h2d_gb_per_s']:>8.1f}{r['achieved_vs_pinned']:>11.3f}{r['max_abs_diff_vs_resident']:>8.1e}"
        )
    m = results["memory"]
    print(f"pinned H2D baseline: {pinned_gbs:.1f} GB/s ({block_h2d_ms:.2f} ms for {streamed_bytes / 2**30:.2f} GiB)")
    print(
        f"device weights after enable: {m['weights_after_enable_bytes'] / 2**20:.1f} MiB vs resident+2 slots "
        f"{m['resident_plus_two_slots_bytes'] / 2**20:.1f} MiB "
        f"(ratio {m['ratio'] if m['ratio'] is None else round(m['ratio'], 3)}); "
        f"whole model {m['model_bytes_resident_run'] / 2**30:.2f} GiB"
    )
    print(
        "targets: compute-bound ratio <= 1.05 (rows where blk cmp ms >= blk h2d ms); transfer-bound vs pinned >= 0.90"
    )
    return results


def checkpoint_stream_rows(args, model, device, dtype, cases, resident_ms, expected, block_h2d_ms) -> list[dict]:
    """The same cases with blocks packed from a safetensors mapping into pinned staging per copy."""
    from safetensors.torch import save_file

    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("blocks.")}
        save_file(state, os.path.join(scratch, "blocks.safetensors"))
        del state
        result = build_checkpoint_mmap_plan(model, PLAN, os.path.join(scratch, "blocks.safetensors"))
        if result.plan is None:
            raise RuntimeError(f"checkpoint preflight failed: {result.fallback_reason}")
        handle = enable_layerwise_offload(
            model, PLAN, device=device, host_weights=result.plan, stream_from_checkpoint=True
        )
        streamed = handle.slot_nbytes * args.blocks  # equal blocks: packed bytes copied per forward
        with torch.inference_mode():
            for name, tokens, batch in cases:
                x, t = inputs(args, tokens, batch, device, dtype)
                offload_ms = time_ms(lambda: model(x, t), device, args.warmup, args.iters)
                diff = (model(x, t).float().cpu() - expected[name]).abs().max().item()
                rows.append(
                    {
                        "case": f"{name}_ckpt_stream",
                        "tokens": tokens,
                        "batch": batch,
                        "resident_ms": resident_ms[name],
                        "offload_ms": offload_ms,
                        "ratio": offload_ms / resident_ms[name],
                        "compute_ms_per_block": resident_ms[name] / args.blocks,
                        "h2d_ms_per_block": block_h2d_ms / args.blocks,
                        "achieved_h2d_gb_per_s": streamed / (offload_ms * 1e-3) / 1e9,
                        "achieved_vs_pinned": block_h2d_ms / offload_ms,
                        "forward_peak_above_weights_bytes": 0,
                        "max_abs_diff_vs_resident": diff,
                        "host_bytes": handle.host_nbytes,
                    }
                )
        handle.remove()
    return rows


def run_allgather(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    backend = "gloo" if args.smoke else "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.smoke:
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    group = dist.group.WORLD

    def wave_ms(fn: Callable[[], object]) -> float:
        """One DP wave: every rank runs its own request; the wave ends when the slowest rank does."""
        ms = time_ms(fn, device, args.warmup, args.iters)
        t = torch.tensor([ms], dtype=torch.float64, device=device if backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    model = build_model(args, device, dtype)
    with torch.inference_mode():
        x, t = inputs(args, args.tokens, 1, device, dtype, seed=10 + rank)  # two different requests
        resident_wave = wave_ms(lambda: model(x, t))
        expected = model(x, t).float().cpu()
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = allocated(device)
    handle = enable_layerwise_offload(model, PLAN, device=device, group=group)
    weights = allocated(device) - before
    with torch.inference_mode():
        offload_wave = wave_ms(lambda: model(x, t))
        diff = (model(x, t).float().cpu() - expected).abs().max().item()

    # Per-block AllGather alone: the slot-sized gather every prefetch issues, from a device shard.
    shard = handle.host_block_buffers[0].numel()
    out = torch.empty(shard * world, dtype=torch.uint8, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag_ms = wave_ms(lambda: gather(out, out[rank * shard : (rank + 1) * shard], group=group))
    shard_h2d_ms = pinned_h2d_ms(handle.host_block_buffers[:1], device, args.warmup, args.iters)
    handle.remove()

    results = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "world_size": world,
        "backend": backend,
        "allgather_ms_per_block": ag_ms,
        "allgather_bytes_per_block": shard * world,
        "allgather_gb_per_s": shard * world / (ag_ms * 1e-3) / 1e9,
        "shard_h2d_ms_per_block": shard_h2d_ms,
        "dp_wave_resident_ms": resident_wave,
        "dp_wave_offload_ms": offload_wave,
        "dp_throughput_ratio": resident_wave / offload_wave,
        "requests_per_s_resident": world / (resident_wave * 1e-3),
        "requests_per_s_offload": world / (offload_wave * 1e-3),
        "weights_per_gpu_bytes": weights,
        "two_slots_plus_resident_bytes": 2 * handle.slot_nbytes + handle.resident_nbytes,
        "host_bytes_per_rank": handle.host_nbytes,
        "max_abs_diff_vs_resident": diff,
    }
    diffs = [None] * world
    dist.all_gather_object(diffs, diff)
    results["max_abs_diff_per_rank"] = diffs
    if rank == 0:
        print(
            f"dlo_offload allgather  world={world} backend={backend} blocks={args.blocks} hidden={args.hidden} "
            f"tokens={args.tokens}"
        )
        print(
            f"per-block AllGather: {ag_ms:.3f} ms for {shard * world / 2**20:.1f} MiB "
            f"-> {results['allgather_gb_per_s']:.1f} GB/s; shard H2D {shard_h2d_ms:.3f} ms"
        )
        print(
            f"DP{world} wave (one request per rank): resident replicas {resident_wave:.2f} ms, AllGather offload "
            f"{offload_wave:.2f} ms -> throughput ratio {results['dp_throughput_ratio']:.3f} (target >= 0.9)"
        )
        print(
            f"device weights per GPU: {weights / 2**20:.1f} MiB vs 2 slots + resident "
            f"{results['two_slots_plus_resident_bytes'] / 2**20:.1f} MiB; host per rank "
            f"{handle.host_nbytes / 2**30:.2f} GiB; max |diff| per rank {diffs}"
        )
    dist.barrier()
    dist.destroy_process_group()
    return results if rank == 0 else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("single", "allgather"), default="single")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON of every figure")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo for allgather)")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--small-tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--checkpoint-stream",
        action="store_true",
        help="single mode: also time stream_from_checkpoint=True (writes the blocks to --scratch)",
    )
    parser.add_argument("--scratch", default=None, help="directory for the --checkpoint-stream safetensors file")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.hidden, args.heads, args.tokens, args.small_tokens = 4, 64, 2, 64, 8
        args.dtype, args.warmup, args.iters = "float32", 1, 2
    dtype = getattr(torch, args.dtype)
    if args.mode == "single":
        device = torch.device("cpu" if args.smoke else "cuda")
        results = run_single(args, device, dtype)
    else:
        results = run_allgather(args, dtype)
    if args.out is not None and results:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"dlo_offload_{args.mode}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
