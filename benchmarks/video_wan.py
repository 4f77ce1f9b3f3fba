"""Wan text-to-video on one GPU: omni's ``VideoFamilyPipeline`` against diffusers' ``WanPipeline``, same modules,
same seed, same run.

    python benchmarks/video_wan.py --out DIR                         # Wan2.1-1.3B, 832x480, 81 frames, 50 steps
    python benchmarks/video_wan.py --size 14b --steps 4 --phases omni,offload --out DIR   # 14B ms/step, offload
    python benchmarks/video_wan.py --smoke --out DIR                 # tiny configs on the CPU (fp32)

Weights are random (``omni_models.synthetic.wan_components``): the released transformer and VAE configs, built on
the meta device and filled on the device; UMT5-XXL keeps its width with ``--text-encoder-layers`` layers. The
transformer and text encoder run in bf16, the VAE in float32 (Wan's code and diffusers' examples). Phases (each
reports the denoising ms/step -- median of the steps after the first, the device synchronized after each -- the
end-to-end seconds per video with text encoding and VAE decode, and the peak device memory):

- ``diffusers``: ``WanPipeline(...)(...)`` over the modules, eager (its VAE untiled, as by default);
- ``omni``: ``build_family_pipeline(wan.FAMILY, ...)`` over the same modules (the VAE tiled), eager, stepwise;
  its frames against diffusers' (PSNR);
- ``cache``: omni with the step cache (``--cache``, default the ``fast`` preset); decisions and PSNR against omni;
- ``compiled``: omni compiled as ``omni-server`` serves on CUDA by default (``FamilyPipeline.compile`` with the
  default ``CompileSettings``: every block of every expert, inductor, symbolic shapes); one first video (the
  compile, its seconds recorded) then the timed one; PSNR against omni;
- ``compiled_cache``: the compiled pipeline with the step cache; PSNR against ``compiled``;
- ``fp8``: omni with FP8 linears (``quantize_family_fp8``, the family's ignore list; the transformer is quantized in
  place, so it runs after the phases above); compiled afresh when ``compiled`` ran (the phase is then
  ``fp8_compiled``, with its first video's seconds); PSNR against omni;
- ``offload``: a fresh omni pipeline whose transformer keeps its blocks in host memory, streamed through two device
  slots (``dlo_offload``): device weight bytes, time and peak memory against ``omni``. The transformer is the one
  ``omni`` ran, moved to the host (PSNR against ``omni``), or, when ``fp8`` or ``compiled`` changed that one in
  place, another random draw of the architecture filled on the device (no PSNR).

Every number lands in ``DIR/video_wan_<size>.json``. Needs diffusers (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# This directory holds scripts named like omni's libraries (fp8_cache.py): keep them from shadowing the packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

PHASES = ("diffusers", "omni", "cache", "compiled", "compiled_cache", "fp8", "offload")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


def step_ms(stamps: list[float]) -> float:
    """The median step time from per-step end stamps (the first step, with its warm-up, is left out)."""
    deltas = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(deltas) if deltas else float("nan")


def components(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from omni_models import synthetic

    dtype = torch.float32 if args.smoke else torch.bfloat16
    built = synthetic.wan_components(
        "wan2.1",
        size="tiny" if args.smoke else args.size,
        device=device,
        dtype=dtype,
        text_encoder_layers=args.text_encoder_layers,
    )
    built["vae"] = torch.nn.Module.to(built["vae"], torch.float32)  # diffusers' .to() warns about keep-in-fp32
    return built


def run_diffusers(built: dict[str, Any], request: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from omni_models.synthetic import diffusers_pipeline
    from omni_models.video import Video

    pipe = diffusers_pipeline("wan", built)
    stamps: list[float] = []

    def on_step(_pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        synchronize(device)
        stamps.append(time.perf_counter())
        return kwargs

    reset_peak(device)
    start = time.perf_counter()
    frames = pipe(
        prompt=request["prompt"],
        negative_prompt=request["negative_prompt"],
        height=request["height"],
        width=request["width"],
        num_frames=request["num_frames"],
        num_inference_steps=request["num_inference_steps"],
        guidance_scale=request["guidance_scale"],
        generator=torch.Generator("cpu").manual_seed(request["seed"]),
        output_type="np",
        callback_on_step_end=on_step,
    ).frames[0]
    synchronize(device)
    seconds = time.perf_counter() - start
    video = Video.from_float(frames, 16)
    return {"ms_per_step": step_ms(stamps), "seconds": seconds, "peak_bytes": peak_memory(device), "video": video}


def run_omni(pipe: Any, request: dict[str, Any], device: torch.device, cache: Any = None) -> dict[str, Any]:
    from omni_models import GenerationRequest, resolve_request

    reset_peak(device)
    start = time.perf_counter()
    jobs = pipe.prepare(resolve_request(pipe.info, GenerationRequest(**request, cache=cache)))
    pipe.start(jobs)
    stamps = []
    while not jobs[0].finished:
        pipe.step(jobs)
        synchronize(device)
        stamps.append(time.perf_counter())
    video = pipe.decode(jobs)[0]
    synchronize(device)
    seconds = time.perf_counter() - start
    decisions = None if jobs[0].step_cache is None else jobs[0].step_cache.stats().decisions
    pipe.release(jobs)
    return {
        "ms_per_step": step_ms(stamps),
        "seconds": seconds,
        "peak_bytes": peak_memory(device),
        "decisions": decisions,
        "video": video,
    }


def omni_pipeline(built: dict[str, Any], device: torch.device, offload: Any = None) -> Any:
    from omni_models.backends import wan
    from omni_models.diffusers_adapter import build_family_pipeline

    dtype = built["transformer"].dtype
    return build_family_pipeline(
        wan.FAMILY,
        built,
        name="wan-random",
        device=device,
        dtype=dtype,
        offloads={} if offload is None else {"transformer": offload},
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=("1.3b", "14b"), default="1.3b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, fp32, 32x48, 5 frames, 3 steps (CPU)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--text-encoder-layers", type=int, default=2)
    parser.add_argument("--cache", default="fast", help="the cache phase's step cache (a preset name)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    if args.smoke:
        args.steps, args.frames, args.width, args.height = 3, 5, 48, 32
    device = torch.device(args.device)
    request = dict(
        prompt="a red fox running through fresh snow in a forest",
        negative_prompt="blurry, low quality",
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        seed=7,
    )
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "request": request}
    built = components(args, device)
    videos: dict[str, Any] = {}

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"video_wan_{'smoke' if args.smoke else args.size}.json"

    def record(name: str, outcome: dict[str, Any], against: str | None = None) -> None:
        videos[name] = outcome.pop("video")
        if against is not None and against in videos:
            outcome[f"psnr_vs_{against}"] = psnr(videos[name].frames, videos[against].frames)
        results[name] = outcome
        print(name, json.dumps(outcome), flush=True)
        path.write_text(json.dumps(results, indent=2))  # after every phase: a run cut short keeps what it finished

    def compiled_run(cache: Any = None) -> dict[str, Any]:
        from omni_models.compilation import compile_count

        graphs = compile_count()
        first = run_omni(pipe, request, device, cache=cache)
        outcome = run_omni(pipe, request, device, cache=cache)
        outcome.update(first_video_s=first["seconds"], graphs_compiled=compile_count() - graphs)
        return outcome

    if "diffusers" in phases:
        record("diffusers", run_diffusers(built, request, device))
    pipe = omni_pipeline(built, device)
    if "omni" in phases:
        record("omni", run_omni(pipe, request, device), "diffusers")
    if "cache" in phases:
        record("cache", run_omni(pipe, request, device, cache=args.cache), "omni")
    compiled = "compiled" in phases
    if compiled:
        from omni_models.compilation import CompileSettings

        settings = CompileSettings(backend="aot_eager" if args.smoke else "inductor")  # smoke: traced, no codegen
        pipe.compile(settings)
        record("compiled", compiled_run(), "omni")
        if "compiled_cache" in phases:
            record("compiled_cache", compiled_run(cache=args.cache), "compiled")
    if "fp8" in phases:
        from omni_models.backends import wan
        from omni_models.integrations import quantize_family_fp8

        if compiled:  # back to the plain blocks, then compile the FP8 ones
            from omni_models.compilation import restore_modules

            restore_modules(pipe.backend.compile_targets())
            torch._dynamo.reset()
        report = quantize_family_fp8(wan.FAMILY.declaration, pipe.transformer)
        if compiled:
            pipe.compile(settings)
        outcome = compiled_run() if compiled else run_omni(pipe, request, device)
        outcome["fp8_linears"] = len(report.quantized)
        record("fp8_compiled" if compiled else "fp8", outcome, "omni")
    if "offload" in phases:
        from dlo_offload import enable_layerwise_offload
        from omni_models.backends import wan
        from omni_models.integrations import family_offload_plan

        del pipe
        changed_in_place = bool({"fp8", "compiled", "compiled_cache"} & set(phases))
        if changed_in_place:  # another random draw, filled on the device, moved out
            host_transformer = components(args, device)["transformer"].to("cpu")
        else:  # the transformer the omni phase ran: its frames are the reference
            host_transformer = built["transformer"].to("cpu")
        fresh = {**built, "transformer": host_transformer}
        del built, host_transformer
        if device.type == "cuda":
            torch.cuda.empty_cache()
            reset_peak(device)
        offload = enable_layerwise_offload(
            fresh["transformer"], family_offload_plan(wan.FAMILY.declaration), device=device, use_allgather=False
        )
        outcome = run_omni(omni_pipeline(fresh, device, offload), request, device)
        outcome["device_weight_bytes"] = int(offload.resident_nbytes + 2 * offload.slot_nbytes)
        record("offload", outcome, None if changed_in_place else "omni")
    for name in ("omni", "cache", "compiled", "compiled_cache", "fp8", "fp8_compiled"):
        if name in results and "diffusers" in results:
            base = results["diffusers"]
            results[f"{name}_vs_diffusers_step"] = base["ms_per_step"] / results[name]["ms_per_step"]
            results[f"{name}_vs_diffusers_e2e"] = base["seconds"] / results[name]["seconds"]
            print(f"{name} vs diffusers eager: {results[f'{name}_vs_diffusers_e2e']:.3f}x end to end")
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
