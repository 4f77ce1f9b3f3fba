"""Every library in one pipeline: omni-shapes-tiny loaded the way omni-server loads it, four ways.

    python benchmarks/composed_pipeline.py --out DIR [--device cuda] [--prompts 40] [--smoke]

- ``paged``: paged KV (diffusion_kv) only, the baseline;
- ``fp8``: plus FP8 linears (fp8_cache, ``torch._scaled_mm`` on a capable GPU);
- ``offload``: plus layerwise offload (dlo_offload: blocks streamed from pinned host memory into two slots);
- ``fp8+offload``: both.

For each: prompt adherence on held-out prompts at guidance 4 (read from pixels), the time of one batched call,
peak device memory, and the pixel difference from the baseline in the same run. Offload alone must draw the
baseline's pixels exactly (it moves bytes, not numbers); FP8 changes numerics, so it is judged by adherence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Scripts beside this one are named like the libraries (fp8_cache.py, dlo_offload.py): drop this directory from
# the import path so that the libraries, not those scripts, are imported.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from omni_models.training.scorer import adherence, read_scenes  # noqa: E402
from omni_models.training.shapes import split_scenes  # noqa: E402
from omni_server.config import build_config  # noqa: E402
from omni_server.engine import load_pipeline  # noqa: E402

VARIANTS: dict[str, dict[str, object]] = {
    "paged": {},
    "fp8": {"quantization": "fp8"},
    "offload": {"enable_layerwise_offload": True},
    "fp8+offload": {"quantization": "fp8", "enable_layerwise_offload": True},
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name: str, device: torch.device, scenes: list, steps: int) -> tuple[dict, torch.Tensor]:
    prompts = [scene.caption() for scene in scenes]
    config = build_config(None, model="omni-shapes-tiny", device=str(device), **VARIANTS[name])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    pipe = load_pipeline(config)
    pipe(prompts[:2], guidance_scale=4.0, seed=100, num_inference_steps=2)  # warm-up: kernels compiled
    synchronize(device)
    start = time.perf_counter()
    images = pipe(prompts, guidance_scale=4.0, seed=100, num_inference_steps=steps)
    synchronize(device)
    seconds = time.perf_counter() - start
    pixels = torch.stack([torch.from_numpy(np.array(image, dtype=np.int16)) for image in images])
    result = {"seconds": seconds, "dtype": str(pipe.dtype), "adherence": adherence(read_scenes(images), scenes)}
    if device.type == "cuda":
        result["peak_device_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return result, pixels


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="4 prompts, 3 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.steps = 4, 3
    device = torch.device(args.device)
    scenes = split_scenes()[1][: args.prompts]

    results: dict[str, dict] = {}
    baseline: torch.Tensor | None = None
    for name in VARIANTS:
        result, pixels = run_variant(name, device, scenes, args.steps)
        if baseline is None:
            baseline = pixels
        difference = (pixels - baseline).abs().float()
        result.update(max_pixel_diff=difference.max().item(), mean_pixel_diff=difference.mean().item())
        results[name] = result

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "steps": args.steps,
        "guidance": 4.0,
        "variants": results,
        "offload_exact": results["offload"]["max_pixel_diff"] == 0.0,
    }
    print(f"omni-shapes-tiny on {summary['device']}, {args.prompts} held-out prompts, {args.steps} steps, guidance 4")
    print(
        f"{'variant':<12} {'attributes':>10} {'scene':>6} {'call s':>8} {'peak MiB':>9} "
        f"{'max|dpx|':>9} {'mean|dpx|':>10}"
    )
    for name, result in results.items():
        score = result["adherence"]
        print(
            f"{name:<12} {score['attributes']:>10.3f} {score['scene']:>6.3f} {result['seconds']:>8.3f} "
            f"{result.get('peak_device_mib', float('nan')):>9.1f} {result['max_pixel_diff']:>9.0f} "
            f"{result['mean_pixel_diff']:>10.3f}"
        )
    print(f"offload draws the baseline's pixels exactly: {summary['offload_exact']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "composed_pipeline.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
