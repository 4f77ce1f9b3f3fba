"""Acoustic stage of the music family (no vLLM needed; for the H200): time per window of the flow-matching
transformer through the paged prefix cache (diffusion_kv, code K/V written once per window) vs dense recompute
of the codes every Euler step, and with FP8 linears; plus a scaled-up random-weight member for GPU-sized work.

Usage:  python benchmarks/music_acoustic.py --out DIR            (GPU if present, else CPU)
Smoke:  python benchmarks/music_acoustic.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from omni_models.flow import euler_times  # noqa: E402
from omni_models.model import CausalPrefixDiT  # noqa: E402
from omni_models.music.acoustic import (  # noqa: E402
    PagedAcoustic,
    acoustic_config,
    acoustic_prefix_ids,
    denoise_window,
    generate_latents_paged,
    window_noise,
)
from omni_models.music.config import MusicConfig  # noqa: E402


def timed(fn, repeats: int, device: str) -> float:  # noqa: ANN001
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def bench(config: MusicConfig, device: str, dtype: torch.dtype, repeats: int, fp8: bool) -> dict:
    dit = CausalPrefixDiT(acoustic_config(config)).to(device=device, dtype=dtype).eval()
    if fp8:
        from omni_models.integrations import quantize_fp8

        quantize_fp8(dit)
    codes = torch.randint(0, 16, (config.window_frames, 8))
    ids = acoustic_prefix_ids(codes, config).to(device)
    times = euler_times(config.acoustic_steps).tolist()
    noise = window_noise(0, 0, config).to(device=device)

    def recompute() -> None:
        with torch.no_grad():
            denoise_window(
                lambda x, t: dit(ids[None], x[None].to(dtype), torch.full((1,), t, device=device))[0].float(),
                noise,
                times,
                None,
            )

    paged = PagedAcoustic(dit, config, device=device, dtype=dtype)

    def paged_window() -> None:
        with torch.no_grad():
            paged.denoise(ids.cpu(), noise.cpu(), times, None)

    song = torch.randint(0, 16, (config.window_frames * 4, 8))
    song_time = timed(lambda: generate_latents_paged(paged, song, seed=0), 1, device)
    audio_seconds = song.shape[0] / config.frame_rate
    out = {
        "recompute_s_per_window": timed(recompute, repeats, device),
        "paged_s_per_window": timed(paged_window, repeats, device),
        "song_seconds": song_time,
        "audio_seconds": audio_seconds,
        "rtf": song_time / audio_seconds,
    }
    out["paged_speedup"] = out["recompute_s_per_window"] / out["paged_s_per_window"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shipped = json.loads(
        (
            Path(__file__).resolve().parents[1] / "packages/models/src/omni_models/weights/omni-tones-tiny/config.json"
        ).read_text()
    )
    tiny = MusicConfig.from_dict(shipped)
    # A Music-3-sized acoustic window (200 frames) on a 1024-wide, 16-layer transformer: GPU-sized work.
    large = dataclasses.replace(
        tiny,
        name="acoustic-large",
        acoustic_width=1024,
        acoustic_depth=16,
        acoustic_heads=16,
        window_frames=200,
        hop_frames=100,
        max_frames=2000,
        max_position_embeddings=4096,
        acoustic_steps=30,
    )
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    members = [("tiny", tiny)] if args.smoke else [("tiny", tiny), ("large", large)]
    for name, config in members:
        results[name] = bench(config, device, dtype, 1 if args.smoke else args.repeats, fp8=False)
        print(name, results[name], flush=True)
        if device == "cuda":
            results[f"{name}_fp8"] = bench(config, device, dtype, args.repeats, fp8=True)
            print(f"{name}_fp8", results[f"{name}_fp8"], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "music_acoustic.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
