"""Prefix K/V reuse across denoising steps vs recomputing the prefix every step (causal-prefix DiT, paged path).

GPU run (large ~2B config, 512 prompt tokens, 1024 image tokens, 30 steps, CFG with a 512-token negative prompt):

    PYTHONPATH=packages/diffusion-kv/src:packages/dlo-offload/src:packages/fp8-cache/src:packages/models/src \
        python benchmarks/prefix_reuse.py --out OUTDIR

Random weights are generated on the device, saved as safetensors in a temporary directory and loaded back
through ``omni_models.load`` (so the timed model is the one a user would load). Both modes run the same job
through ``diffusion_kv``'s paged ops:
- reuse:     ``start`` writes the prefix K/V once, then every step computes image tokens only and reads them;
- recompute: every step runs prompt and image tokens through every block (a model without prefix caching).
The ideal saving comes from counting FLOPs (linears + attention) of both schedules; the target is realising
at least 90% of it. The final latents of both modes are compared (they must agree within bf16 noise).
``--smoke`` runs tiny sizes on the CPU.

It then checks the shipped omni-shapes-tiny on the same device end to end (``pipe(...)``: paged path, Triton
kernels on CUDA) against the dense SDPA path: adherence on the first held-out prompts and the pixel difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from omni_models.checkpoint import save_config, save_weights
from omni_models.config import DiTConfig, large_config
from omni_models.flow import euler_times, initial_noise
from omni_models.model import CausalPrefixDiT
from omni_models.pipeline import Pipeline
from omni_models.registry import load
from omni_models.request import ResolvedRequest
from omni_models.runner import GenerationJob, GenerationRow
from omni_models.training.scorer import adherence, read_scenes
from omni_models.training.shapes import split_scenes


def layer_flops(config: DiTConfig, prefix_len: int, target_len: int) -> tuple[float, float]:
    """(prefix pass, one target step) forward FLOPs of one row through all blocks (multiply-add = 2 FLOPs).

    Linears: qkv 6W^2 + proj 2W^2 + MLP 4 * mlp_ratio * W^2 per token. Attention: 4W per (query, key) pair;
    prefix queries are causal (P(P+1)/2 pairs), image queries see all P + T keys. Per-row adaLN terms are the
    same in both schedules and negligible; they are left out.
    """
    w = config.width
    per_token = (8 + 4 * config.mlp_ratio) * w * w
    prefix = per_token * prefix_len + 4 * w * prefix_len * (prefix_len + 1) / 2
    target = per_token * target_len + 4 * w * target_len * (prefix_len + target_len)
    return config.depth * prefix, config.depth * target


def make_job(config: DiTConfig, prefix_len: int, height: int, width: int, steps: int, seed: int) -> GenerationJob:
    generator = torch.Generator().manual_seed(seed)
    target_len = config.num_image_tokens(height, width)
    rows = tuple(
        GenerationRow(
            role,
            tuple([1] + torch.randint(2, config.vocab_size, (prefix_len - 1,), generator=generator).tolist()),
            target_len,
        )
        for role in ("cond", "uncond")
    )
    request = ResolvedRequest(
        prompt="<random tokens>",
        negative_prompt="<random tokens>",
        n=1,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=4.0,
        true_cfg_scale=None,
        seed=seed,
    )
    return GenerationJob(
        request=request,
        rows=rows,
        latents=initial_noise(seed, (config.in_channels, height, width)),
        times=tuple(euler_times(steps).tolist()),
    )


def run_image(pipe: Pipeline, template: GenerationJob, rows: tuple, *, reuse: bool) -> GenerationJob:
    """A fresh copy of the job through every step on the bound pool, whose row table holds ``rows``."""
    job = GenerationJob(
        request=template.request,
        rows=template.rows,
        latents=template.latents.to(pipe.device),
        times=template.times,
        kv_rows=rows,
    )
    if reuse:
        pipe.start([job])
    for _ in range(job.num_steps):
        pipe.step([job], recompute_prefix=not reuse)
    return job


def timed(
    pipe: Pipeline, job: GenerationJob, rows: tuple, reuse: bool, repeats: int
) -> tuple[list[float], torch.Tensor]:
    run_image(pipe, job, rows, reuse=reuse)  # warm-up (kernel compilation, allocator)
    times = []
    result = None
    for _ in range(repeats):
        if pipe.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = run_image(pipe, job, rows, reuse=reuse)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            result = run_image(pipe, job, rows, reuse=reuse)
            times.append(time.perf_counter() - t0)
    return times, result.latents.float()


def check_shipped_model(device: torch.device, num_prompts: int, num_steps: int) -> dict:
    """Shipped model through ``__call__`` on ``device``: paged vs dense pixels, adherence at guidance 4."""
    scenes = split_scenes()[1][:num_prompts]
    prompts = [scene.caption() for scene in scenes]
    results = {}
    pixels = {}
    for backend in ("paged", "dense"):
        pipe = load("omni-shapes-tiny", device=device, attention_backend=backend)
        start = time.perf_counter()
        images = pipe(prompts, guidance_scale=4.0, seed=100, num_inference_steps=num_steps)
        results[f"{backend}_seconds"] = time.perf_counter() - start
        results[f"{backend}_adherence"] = adherence(read_scenes(images), scenes)
        pixels[backend] = torch.stack([torch.from_numpy(np.array(image, dtype=np.int16)) for image in images])
    difference = (pixels["paged"] - pixels["dense"]).abs().float()
    results.update(
        num_prompts=num_prompts,
        num_steps=num_steps,
        dtype=str(pipe.dtype),
        max_pixel_diff=difference.max().item(),
        mean_pixel_diff=difference.mean().item(),
    )
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for prefix_reuse.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side; patch 2 -> (size/2)^2 tokens")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed images per mode (median and spread)")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay each step as a CUDA graph (omni_models.graphs), in both modes",
    )
    parser.add_argument("--skip-shipped", action="store_true", help="skip the shipped-model check")
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
        args.steps, args.prompt_tokens, args.image_size, args.block_size, args.repeats = 3, 12, 8, 16, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("prefix_reuse needs a CUDA device (use --smoke on CPU)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = large_config()
        config = DiTConfig.from_dict(
            {
                **config.to_dict(),
                "max_prompt_tokens": max(config.max_prompt_tokens, args.prompt_tokens),
                "supported_sizes": [[args.image_size, args.image_size]],
            }
        )

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = CausalPrefixDiT(config)
        # Random (non-zero) adaLN and output weights, so the image path really depends on every layer.
        for block in model.blocks:
            torch.nn.init.normal_(block.modulation.weight, std=0.02)
        torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    model.to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        save_weights(model.state_dict(), Path(tmp), max_shard_bytes=2 * 1024**3)
        save_config(config, tuple(["<pad>", "<bos>"] + [f"t{i}" for i in range(config.vocab_size - 2)]), Path(tmp))
        del model
        saved_s = time.perf_counter() - t0
        pipe = load(tmp, device=device, dtype=dtype, cuda_graphs=args.cuda_graphs and device.type == "cuda")
    setup_s = time.perf_counter() - t0

    job = make_job(config, args.prompt_tokens, args.image_size, args.image_size, args.steps, seed=1)
    pipe.allocate_kv_caches_for([job], args.block_size)  # a pool of exactly the job's rows
    rows = job.kv_rows

    reuse_times, reuse_latents = timed(pipe, job, rows, True, args.repeats)
    recompute_times, recompute_latents = timed(pipe, job, rows, False, args.repeats)
    t_reuse, t_recompute = statistics.median(reuse_times), statistics.median(recompute_times)

    prefix_flops, target_flops = layer_flops(config, args.prompt_tokens, job.rows[0].target_len)
    rows = len(job.rows)
    flops_reuse = rows * (prefix_flops + args.steps * target_flops)
    flops_recompute = rows * args.steps * (prefix_flops + target_flops)
    ideal_saving = 1 - flops_reuse / flops_recompute
    measured_saving = 1 - t_reuse / t_recompute
    diff = (reuse_latents - recompute_latents).abs()
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": config.to_dict(),
        "parameters": num_params,
        "dtype": str(dtype),
        "prompt_tokens": args.prompt_tokens,
        "image_tokens": job.rows[0].target_len,
        "rows": rows,
        "steps": args.steps,
        "block_size": args.block_size,
        "setup_seconds": setup_s,
        "save_seconds": saved_s,
        "reuse_seconds": reuse_times,
        "recompute_seconds": recompute_times,
        "speedup": t_recompute / t_reuse,
        "ideal_speedup": flops_recompute / flops_reuse,
        "measured_saving": measured_saving,
        "ideal_saving": ideal_saving,
        "fraction_of_ideal_saving": measured_saving / ideal_saving,
        # The i-th reuse image against the i-th recompute image: the spread of the fraction over the repeats.
        "fraction_of_ideal_per_pair": [
            (1 - a / b) / ideal_saving for a, b in zip(reuse_times, recompute_times, strict=True)
        ],
        "cuda_graphs": bool(args.cuda_graphs and device.type == "cuda"),
        "achieved_tflops_reuse": flops_reuse / t_reuse / 1e12,
        "achieved_tflops_recompute": flops_recompute / t_recompute / 1e12,
        "latents_max_abs_diff": diff.max().item(),
        "latents_rel_l2_diff": (diff.norm() / recompute_latents.norm()).item(),
    }
    print(
        f"{result['device']}  {num_params / 1e9:.2f}B params  P={args.prompt_tokens} T={result['image_tokens']} "
        f"rows={rows} steps={args.steps} {dtype}"
    )
    print(f"{'mode':<12}{'image s':>10}{'TFLOP/s':>10}")
    print(f"{'recompute':<12}{t_recompute:>10.3f}{result['achieved_tflops_recompute']:>10.1f}")
    print(f"{'reuse':<12}{t_reuse:>10.3f}{result['achieved_tflops_reuse']:>10.1f}")
    pairs = result["fraction_of_ideal_per_pair"]
    print(
        f"speedup {result['speedup']:.3f}x (ideal {result['ideal_speedup']:.3f}x); median saving {measured_saving:.1%} "
        f"of ideal {ideal_saving:.1%} -> {result['fraction_of_ideal_saving']:.1%} of ideal (target >= 90%); "
        f"{len(pairs)} pairs {min(pairs):.1%}..{max(pairs):.1%}"
    )
    print(
        f"reuse vs recompute latents: max abs diff {result['latents_max_abs_diff']:.3e}, "
        f"rel L2 {result['latents_rel_l2_diff']:.3e}"
    )
    if not args.skip_shipped:
        del pipe
        shipped = check_shipped_model(device, *((2, 2) if args.smoke else (40, 20)))
        result["shipped_model"] = shipped
        paged_score, dense_score = shipped["paged_adherence"], shipped["dense_adherence"]
        print(
            f"omni-shapes-tiny on {device.type} ({shipped['dtype']}), {shipped['num_prompts']} held-out prompts, "
            f"guidance 4: attributes paged {paged_score['attributes']:.1%} / dense {dense_score['attributes']:.1%}; "
            f"paged vs dense pixels max {shipped['max_pixel_diff']:.0f}, mean {shipped['mean_pixel_diff']:.3f}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_reuse.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
