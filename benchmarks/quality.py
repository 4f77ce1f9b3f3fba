"""Image quality of one serving configuration against a reference configuration, on the shapes world.

    python benchmarks/quality.py MODEL [--quantization fp8] [--fp8-cache-dir DIR] [--enable-layerwise-offload]
        [--attention-dtype fp8]
        [--cache PRESET_OR_JSON ...] [--steps N] [--guidance-scale G] [--num-scenes N] [--device cpu|cuda] [--out DIR]

MODEL is anything ``omni_models.load`` resolves whose images show the shapes world: the shipped
``omni-shapes-tiny`` (32x32, causal-prefix DiT) or a diffusers FLUX.1 checkpoint such as
``omni-flux-shapes-tiny`` (64x64); images are drawn at the model's native size (``inspect(MODEL).info``). In
one run, both configurations draw
the first ``--num-scenes`` held-out scenes of ``omni_models.training.shapes`` (never seen in training), full
captions, scene i from noise seed ``--seed + i``, with the same steps and guidance:

- reference: the model in the device's default dtype (fp32 on CPU, bf16 on CUDA), no FP8, no offload;
- candidate: the same plus the serving options given (FP8 online, FP8 from ``--fp8-cache-dir``: the cache is
  filled first if cold and the images come from a warm load; layerwise offload);
- with ``--cache`` (repeatable: a preset name or a JSON object of knobs, as a request's ``cache`` field), one
  candidate per step cache, on the reference's loaded model. Both configurations then run through the stepwise
  contract (``prepare``/``start``/``step``/``decode``, one request per scene, the scenes of a batch in one forward,
  as the server runs them), and each candidate also reports its computed-step fraction and the fraction of
  repeated-block evaluations it ran (the FLOP fraction of the blocks, from the jobs' ``StepCacheStats``).

It reports, for each configuration, prompt adherence read back from pixels by ``training.scorer`` (images of
another size are box-downsampled to the scorer's 32x32 first), and for the candidate the PSNR and SSIM of each
image against the reference's, the adherence deltas in points and the time ratio. The table goes to stdout,
everything (per-image figures too) to ``--out``/quality.json.

Loading: ``omni_models.load``, the one loader of every model kind (the server maps its flags onto it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# This folder holds scripts named like the packages (fp8_cache.py, dlo_offload.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from omni_models.training.scorer import ATTRIBUTES, adherence, read_scenes  # noqa: E402
from omni_models.training.shapes import IMAGE_SIZE, split_scenes  # noqa: E402


@dataclass(frozen=True)
class ServingOptions:
    """What a configuration changes from the reference: the options ``omni-server`` takes for them."""

    quantization: str | None = None
    fp8_cache_dir: str | None = None
    layerwise_offload: bool = False
    cache: str | None = None  # a step cache: a preset name or a JSON object of knobs
    attention_dtype: str = "auto"

    def label(self) -> str:
        parts = ([f"fp8 ({'cache' if self.fp8_cache_dir else 'online'})"] if self.quantization else []) + (
            ["layerwise offload"] if self.layerwise_offload else []
        )
        if self.attention_dtype != "auto":
            parts.append(f"{self.attention_dtype} attention")
        if self.cache is not None:
            parts.append(f"cache {self.cache}")
        return ", ".join(parts) or "reference"


@dataclass
class Run:
    """One configuration's images (in scene order), timings and adherence."""

    options: ServingOptions
    images: list[Image.Image]
    load_s: float
    generate_s: float
    adherence: dict[str, float]
    step_cache: list[Any] | None = None  # one StepCacheStats per image (a step-cache candidate)


def native_side(model: str) -> int:
    """The model's own square side (its first listed size: 32 for omni-shapes-tiny, 64 for
    omni-flux-shapes-tiny), from its metadata alone."""
    import omni_models

    width, height = omni_models.inspect(model).info.image.sizes[0]
    if width != height:
        raise SystemExit(f"{model}: native size {width}x{height} is not square; the shapes world is")
    return width


def load(model: str, options: ServingOptions, *, device: str, dtype: torch.dtype | None) -> Any:
    """The pipeline as the server would build it for ``options`` (see the module docstring)."""
    import omni_models

    return omni_models.load(
        model,
        device=device,
        dtype=dtype,
        quantization=options.quantization,
        fp8_cache_dir=options.fp8_cache_dir,
        layerwise_offload=options.layerwise_offload,
        attention_dtype=options.attention_dtype,
    )


def scorer_pixels(images: list[Image.Image]) -> np.ndarray:
    """uint8 [N, 32, 32, 3]: each image box-downsampled to the scorer's size (a 32x32 image is unchanged)."""
    size = (IMAGE_SIZE, IMAGE_SIZE)
    return np.stack([np.asarray(image.convert("RGB").resize(size, Image.BOX), dtype=np.uint8) for image in images])


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of two uint8 images in dB over every pixel and channel; ``inf`` when they are identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def ssim_batch(a: np.ndarray, b: np.ndarray, window: int = 7, sigma: float = 1.5) -> list[float]:
    """Mean SSIM of each pair of uint8 RGB images [N, H, W, 3]: Gaussian window, the usual constants, each channel
    alone, in float64.

    The window is 7 pixels (not the common 11) so that a 32x32 image still has 26x26 valid windows. The separable
    Gaussian filter runs as two banded matrix products over the whole batch (float64 convolutions are slow on a
    CPU: one call per image took 0.2 s here, so 200 images outlasted a GPU run's time limit).
    """
    x = torch.tensor(a, dtype=torch.float64).permute(0, 3, 1, 2)  # [N, 3, H, W]
    y = torch.tensor(b, dtype=torch.float64).permute(0, 3, 1, 2)
    offsets = torch.arange(window, dtype=torch.float64) - (window - 1) / 2
    g = torch.exp(-(offsets**2) / (2 * sigma**2))
    g = g / g.sum()

    def band(n: int) -> torch.Tensor:  # [n - window + 1, n]: row i holds g at columns i .. i + window - 1
        rows = torch.arange(n - window + 1).view(-1, 1) + torch.arange(window).view(1, -1)
        return torch.zeros(n - window + 1, n, dtype=torch.float64).scatter_(1, rows, g.expand_as(rows).clone())

    rows, columns = band(x.shape[2]), band(x.shape[3]).T

    def blur(t: torch.Tensor) -> torch.Tensor:
        return rows @ t @ columns

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return index.flatten(1).mean(dim=1).tolist()


def ssim(a: np.ndarray, b: np.ndarray, window: int = 7, sigma: float = 1.5) -> float:
    """Mean SSIM of two uint8 RGB images [H, W, 3] (``ssim_batch`` of one pair)."""
    return ssim_batch(a[None], b[None], window, sigma)[0]


def generate(
    pipe: Any, prompts: list[str], *, seed: int, steps: int | None, guidance: float | None, size: int, batch_size: int
) -> list[Image.Image]:
    """Prompt i from seed ``seed + i``, in batches (both pipeline kinds seed a batch's prompts consecutively)."""
    images: list[Image.Image] = []
    for start in range(0, len(prompts), batch_size):
        images += pipe(
            prompts[start : start + batch_size],
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=seed + start,
            height=size,
            width=size,
        )
    return images


def cache_value(text: str | None) -> Any:
    """``--cache`` as a request's ``cache`` field: a preset name, or the object a JSON text holds."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    return json.loads(text)


def generate_stepwise(
    pipe: Any,
    prompts: list[str],
    *,
    seed: int,
    steps: int | None,
    guidance: float | None,
    size: int,
    batch_size: int,
    cache: str | None,
) -> tuple[list[Image.Image], list[Any]]:
    """Scene i as its own request (seed ``seed + i``, no negative prompt, ``cache``), ``batch_size`` requests per
    forward through the stepwise contract; the images and each image's ``StepCacheStats`` (None without a cache)."""
    from omni_models import GenerationRequest, resolve_request

    images: list[Image.Image] = []
    stats: list[Any] = []
    for start in range(0, len(prompts), batch_size):
        jobs = []
        for index, prompt in enumerate(prompts[start : start + batch_size]):
            request = GenerationRequest(
                prompt=prompt,
                negative_prompt=None,
                num_inference_steps=steps,
                guidance_scale=guidance,
                seed=seed + start + index,
                height=size,
                width=size,
                cache=cache_value(cache),
            )
            jobs += pipe.prepare(resolve_request(pipe.info, request))
        if getattr(pipe.info, "paged_kv", False):
            pipe.allocate_kv_caches_for(jobs, 16)
        pipe.start(jobs)
        while not jobs[0].finished:
            pipe.step(jobs)
        images += pipe.decode(jobs)
        stats += [None if job.step_cache is None else job.step_cache.stats() for job in jobs]
        pipe.release(jobs)
    return images, stats


def run_configuration(
    model: str,
    options: ServingOptions,
    prompts: list[str],
    scenes: list,
    args: argparse.Namespace,
    size: int,
    loaded: Any = None,
) -> Run:
    if options.fp8_cache_dir is not None:  # a cold cache is filled by this load; the images come from a warm one
        fill_start = time.perf_counter()
        load(model, options, device=args.device, dtype=args.dtype)
        print(
            f"fp8 cache at {options.fp8_cache_dir} filled or checked in {time.perf_counter() - fill_start:.1f}s",
            flush=True,
        )
    start = time.perf_counter()
    pipe = loaded if loaded is not None else load(model, options, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    stats = None
    if args.cache:
        images, stats = generate_stepwise(
            pipe,
            prompts,
            seed=args.seed,
            steps=args.steps,
            guidance=args.guidance_scale,
            size=size,
            batch_size=args.batch_size,
            cache=options.cache,
        )
    else:
        images = generate(
            pipe,
            prompts,
            seed=args.seed,
            steps=args.steps,
            guidance=args.guidance_scale,
            size=size,
            batch_size=args.batch_size,
        )
    generate_s = time.perf_counter() - start
    scores = adherence(read_scenes(scorer_pixels(images)), scenes)
    print(
        f"{options.label()}: loaded in {load_s:.1f}s, {len(images)} images in {generate_s:.1f}s, "
        f"attributes {scores['attributes']:.4f}",
        flush=True,
    )
    return Run(options, images, load_s, generate_s, scores, stats)


def compare(reference: Run, candidate: Run) -> dict[str, Any]:
    """Per-image PSNR/SSIM of the candidate against the reference, and the adherence deltas in points."""
    pairs = [
        (np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))
        for a, b in zip(reference.images, candidate.images, strict=True)
    ]
    psnrs = [psnr_db(a, b) for a, b in pairs]
    ssims = ssim_batch(np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs]))
    finite = [p for p in psnrs if math.isfinite(p)]
    median = statistics.median(psnrs)
    keys = (*ATTRIBUTES, "attributes", "scene")
    cache = None
    if candidate.step_cache is not None:
        computed = [s.computed_fraction for s in candidate.step_cache]
        blocks = [s.block_fraction for s in candidate.step_cache]
        cache = {
            "computed_step_fraction_mean": statistics.fmean(computed),
            "block_fraction_mean": statistics.fmean(blocks),
            "flop_saving_of_blocks": 1 - statistics.fmean(blocks),
            "decisions": [s.decisions for s in candidate.step_cache],
        }
    return {  # PSNR None: identical images (JSON has no infinity); the minimum is over the images that differ
        "step_cache": cache,
        "psnr_db_min": min(finite) if finite else None,
        "psnr_db_median": median if math.isfinite(median) else None,
        "identical_images": len(psnrs) - len(finite),
        "ssim_mean": statistics.fmean(ssims),
        "ssim_min": min(ssims),
        "adherence_delta_points": {k: 100 * (candidate.adherence[k] - reference.adherence[k]) for k in keys},
        "generate_time_ratio": candidate.generate_s / reference.generate_s,
        "per_image": [
            {"psnr_db": p if math.isfinite(p) else None, "ssim": s} for p, s in zip(psnrs, ssims, strict=True)
        ],
    }


def print_table(reference: Run, candidate: Run, comparison: dict[str, Any]) -> None:
    cache = comparison["step_cache"]
    if cache is not None:
        print(
            f"{candidate.options.label()}: computed steps {cache['computed_step_fraction_mean']:.3f}, blocks run "
            f"{cache['block_fraction_mean']:.3f} (FLOP saving of the blocks {cache['flop_saving_of_blocks']:.3f})"
        )
    keys = ("attributes", *ATTRIBUTES, "scene")
    print(f"{'configuration':28s}" + "".join(f"{k:>12s}" for k in keys) + f"{'generate s':>12s}")
    for run in (reference, candidate):
        print(
            f"{run.options.label():28s}"
            + "".join(f"{100 * run.adherence[k]:11.2f}%" for k in keys)
            + f"{run.generate_s:12.1f}"
        )
    deltas = comparison["adherence_delta_points"]
    print(
        f"{'delta (points) / ratio':28s}"
        + "".join(f"{deltas[k]:+11.2f} " for k in keys)
        + f"{comparison['generate_time_ratio']:11.3f}x"
    )
    low, median = comparison["psnr_db_min"], comparison["psnr_db_median"]
    print(
        f"PSNR vs reference: min {'identical' if low is None else f'{low:.2f} dB'}, median "
        f"{'identical' if median is None else f'{median:.2f} dB'}, {comparison['identical_images']} identical images; "
        f"SSIM mean {comparison['ssim_mean']:.4f}, min {comparison['ssim_min']:.4f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="shipped name, local directory or cached repo id")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--fp8-cache-dir", default=None, metavar="DIR")
    parser.add_argument("--enable-layerwise-offload", action="store_true")
    parser.add_argument("--attention-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument(
        "--cache",
        action="append",
        default=[],
        metavar="PRESET_OR_JSON",
        help="a step cache to compare (repeatable: one candidate each), e.g. safe, fast or '{\"threshold\": 0.1}'",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="(default: the model's)")
    parser.add_argument("--num-scenes", type=int, default=40, help="first N of the 200 held-out scenes")
    parser.add_argument("--seed", type=int, default=10_000, help="scene i uses noise seed SEED + i")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per pipeline call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="both configurations (default: fp32 on CPU, bf16 on CUDA)",
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for quality.json")
    args = parser.parse_args(argv)
    if args.fp8_cache_dir is not None and args.quantization != "fp8":
        parser.error("--fp8-cache-dir needs --quantization fp8")
    args.dtype = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    scenes = split_scenes()[1][: args.num_scenes]
    prompts = [scene.caption() for scene in scenes]
    size = native_side(args.model)
    serving = ServingOptions(
        args.quantization, args.fp8_cache_dir, args.enable_layerwise_offload, attention_dtype=args.attention_dtype
    )
    if serving == ServingOptions() and not args.cache:
        raise SystemExit(
            "give at least one option to compare (--quantization, --enable-layerwise-offload, --attention-dtype, "
            "--cache)"
        )
    if args.cache and serving != ServingOptions():
        raise SystemExit("--cache candidates run on the reference's model: give --cache without serving options")
    pipe = load(args.model, ServingOptions(), device=args.device, dtype=args.dtype) if args.cache else None
    reference = run_configuration(args.model, ServingOptions(), prompts, scenes, args, size, loaded=pipe)
    candidates = []
    if args.cache:
        for value in args.cache:
            options = ServingOptions(cache=value)
            candidates.append(run_configuration(args.model, options, prompts, scenes, args, size, loaded=pipe))
    else:
        candidates.append(run_configuration(args.model, serving, prompts, scenes, args, size))
    comparisons = []
    for candidate in candidates:
        comparisons.append(compare(reference, candidate))
        print_table(reference, candidate, comparisons[-1])
    candidate, comparison = candidates[0], comparisons[0]
    record = {
        "model": args.model,
        "device": args.device,
        "dtype": str(args.dtype or "default"),
        "size": size,
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "scenes": len(scenes),
        "seed": args.seed,
        "argv": sys.argv,
        "configurations": {
            run.options.label(): {
                "options": vars(run.options),
                "adherence": run.adherence,
                "load_s": run.load_s,
                "generate_s": run.generate_s,
            }
            for run in (reference, *candidates)
        },
        "comparison": comparison,
        "comparisons": {run.options.label(): c for run, c in zip(candidates, comparisons, strict=True)},
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quality.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
