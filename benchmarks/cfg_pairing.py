"""Scheduler time per step with the CFG pairing patches vs without, on vLLM's real v1 Scheduler (CPU).

This is a CPU benchmark: the scheduler is pure Python and vLLM is not on the GPU machine. One process builds
vLLM's ``Scheduler`` from configs made here (a tiny llama config written to a temp dir, no downloads, no
model) and drives engine steps the way the engine core does: ``schedule()``, a model-runner output with one
sampled token for every request that reached its end, ``update_from_output()``. Only the two scheduler calls
are timed.

The unpatched and the patched scheduler run side by side in one loop, one step each in turn (which goes
first alternates), so both see the same spells of machine load.

Two workloads, each run on the unpatched class and on a patched subclass of the same class:
  plain: ``--requests`` plain requests (the patches' fast path; target <= 1.05x)
  cfg:   the same number of requests as cond/uncond pairs (half of them) + plain traffic; the unpatched
         scheduler treats the pair members as plain requests, the patched one holds, reorders, equalizes,
         gates admission and finishes pairs together (target <= 1.05x per step)
Prompt lengths, output lengths and arrival steps come from one seeded RNG, so both sides see the same
workload. Each workload runs ``--repeats`` times, garbage collection paused; per side the figure is the
median over runs of (scheduler CPU time of the run / steps in the run), and the ratio is the median of the
per-run patched/unpatched ratios (each run pairs the two sides under the same load). Thread CPU time is used
because the machine is shared; wall time is reported too.

Usage:  python benchmarks/cfg_pairing.py --out DIR        (about a minute on 2 busy cores)
Smoke:  python benchmarks/cfg_pairing.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This script is named like the package it measures; drop its own directory from the import path so that
# `import cfg_pairing` finds the library, not this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from cfg_pairing import CFGPairingScheduler  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
TARGET_RATIO = 1.05


def tiny_model_config(directory: Path) -> ModelConfig:
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 1,
                "vocab_size": 32000,
                "max_position_embeddings": MAX_MODEL_LEN,
                "torch_dtype": "float32",
            }
        )
    )
    return ModelConfig(
        model=str(directory), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32", seed=0
    )


def build_scheduler(cls: type, model_config: ModelConfig, args: argparse.Namespace) -> Any:
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True)
    cache_config.num_gpu_blocks = args.num_blocks
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=args.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


def workload(kind: str, args: argparse.Namespace) -> list[tuple[int, str, list[int], int, dict[str, Any] | None]]:
    """``(arrival_step, request_id, prompt, max_tokens, extra_args)`` for every request, seeded."""
    rng = random.Random(args.seed)
    items = []
    index = 0
    while index < args.requests:
        arrival = rng.randrange(args.arrival_steps)
        prompt_len = rng.randrange(args.min_prompt, args.max_prompt + 1)
        max_tokens = rng.randrange(args.min_output, args.max_output + 1)
        if kind == "cfg" and index % 4 < 2 and index + 1 < args.requests:
            base = f"pair-{index}"
            cond_prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
            uncond_prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
            items.append((arrival, base, cond_prompt, max_tokens, {"cfg_role": "cond"}))
            items.append((arrival, f"{base}__cfg_uncond", uncond_prompt, max_tokens, {"cfg_role": "uncond"}))
            index += 2
        else:
            prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
            items.append((arrival, f"plain-{index}", prompt, max_tokens, None))
            index += 1
    return items


class Side:
    """One scheduler working through its own copy of the workload, timed step by step."""

    def __init__(self, cls: type, model_config: ModelConfig, kind: str, args: argparse.Namespace) -> None:
        self.scheduler = build_scheduler(cls, model_config, args)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.arrivals: dict[int, list[Request]] = {}
        for arrival, request_id, prompt, max_tokens, extra_args in workload(kind, args):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
            self.arrivals.setdefault(arrival, []).append(Request(request_id, prompt, params, None, block_hasher=hasher))
        self.last_arrival = max(self.arrivals)
        self.baseline_free = self.free_blocks()
        self.cpu_ns = self.wall_ns = self.steps = self.tokens = 0

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def busy(self, step: int) -> bool:
        return step <= self.last_arrival or self.scheduler.has_unfinished_requests()

    def step(self, step: int) -> None:
        scheduler = self.scheduler
        for request in self.arrivals.pop(step, ()):
            scheduler.add_request(request)
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        output = scheduler.schedule()
        self.cpu_ns += time.thread_time_ns() - cpu0
        self.wall_ns += time.perf_counter_ns() - wall0
        request_ids = list(output.num_scheduled_tokens)
        requests = scheduler.requests
        sampled = [[11] if requests[rid].num_computed_tokens >= requests[rid].num_tokens else [] for rid in request_ids]
        runner_output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={rid: i for i, rid in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        scheduler.update_from_output(output, runner_output)
        self.cpu_ns += time.thread_time_ns() - cpu0
        self.wall_ns += time.perf_counter_ns() - wall0
        self.steps += 1
        self.tokens += output.total_num_scheduled_tokens

    def summary(self) -> dict[str, float]:
        if self.free_blocks() != self.baseline_free:
            raise RuntimeError("KV blocks leaked: the pool did not return to its baseline")
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "cpu_us_per_step": self.cpu_ns / self.steps / 1e3,
            "wall_us_per_step": self.wall_ns / self.steps / 1e3,
        }


def run_lockstep(
    classes: dict[str, type], model_config: ModelConfig, kind: str, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Both schedulers step in turn (order alternating per step), so they share the machine's busy spells."""
    sides = {name: Side(cls, model_config, kind, args) for name, cls in classes.items()}
    order = list(sides.values())
    # Collector pauses land on whichever step happens to trigger them; keep them out of both sides.
    gc.collect()
    gc.disable()
    try:
        step = 0
        while any(side.busy(step) for side in order):
            for side in order:
                if side.busy(step):
                    side.step(step)
            order.reverse()
            step += 1
            if step > 100_000:
                raise RuntimeError("workload did not drain; check the pool size")
    finally:
        gc.enable()
    return {name: side.summary() for name, side in sides.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for cfg_pairing.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, checks the script end to end")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--arrival-steps", type=int, default=60)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=768)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.requests, args.arrival_steps = 1, 16, 4
        args.max_prompt, args.max_output, args.num_blocks = 96, 20, 512

    init_none_hash(sha256)
    patched_cls = CFGPairingScheduler
    with tempfile.TemporaryDirectory() as tmp:
        model_config = tiny_model_config(Path(tmp))
        results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
        rows = []
        for kind in ("plain", "cfg"):
            runs: dict[str, list[dict[str, float]]] = {"unpatched": [], "patched": []}
            for _ in range(args.repeats):
                for side, figures in run_lockstep(
                    {"unpatched": Scheduler, "patched": patched_cls}, model_config, kind, args
                ).items():
                    runs[side].append(figures)
            summary = {
                side: {
                    "steps": statistics.median(r["steps"] for r in side_runs),
                    "tokens": statistics.median(r["tokens"] for r in side_runs),
                    "cpu_us_per_step": statistics.median(r["cpu_us_per_step"] for r in side_runs),
                    "wall_us_per_step": statistics.median(r["wall_us_per_step"] for r in side_runs),
                    "runs": side_runs,
                }
                for side, side_runs in runs.items()
            }
            # Each lockstep run pairs the two sides under the same load: the ratio is taken per run.
            cpu_ratios = [
                p["cpu_us_per_step"] / u["cpu_us_per_step"]
                for p, u in zip(runs["patched"], runs["unpatched"], strict=True)
            ]
            wall_ratios = [
                p["wall_us_per_step"] / u["wall_us_per_step"]
                for p, u in zip(runs["patched"], runs["unpatched"], strict=True)
            ]
            cpu_ratio, wall_ratio = statistics.median(cpu_ratios), statistics.median(wall_ratios)
            results[kind] = summary | {
                "cpu_ratio": cpu_ratio,
                "wall_ratio": wall_ratio,
                "cpu_ratio_per_run": cpu_ratios,
                "wall_ratio_per_run": wall_ratios,
            }
            rows.append((kind, summary, cpu_ratio, wall_ratio))

    print(f"vLLM v1 Scheduler, CPU, {args.requests} requests, median of {args.repeats} lockstep runs")
    header = ("workload", "side", "steps", "cpu us/step", "wall us/step", "ratio (cpu)", "ratio (wall)")
    print("{:<8} {:<10} {:>6} {:>12} {:>13} {:>12} {:>13}".format(*header))
    for kind, summary, cpu_ratio, wall_ratio in rows:
        for side in ("unpatched", "patched"):
            s = summary[side]
            ratios = (cpu_ratio, wall_ratio) if side == "patched" else (1.0, 1.0)
            print(
                f"{kind:<8} {side:<10} {s['steps']:>6.0f} {s['cpu_us_per_step']:>12.1f} {s['wall_us_per_step']:>13.1f} "
                f"{ratios[0]:>12.3f} {ratios[1]:>13.3f}"
            )
    for kind, *_ in rows:
        per_run = results[kind]["cpu_ratio_per_run"]
        print(f"{kind}: per-run cpu ratios {min(per_run):.3f}..{max(per_run):.3f}")
    print(f"target: patched/unpatched <= {TARGET_RATIO}x per step")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cfg_pairing.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
