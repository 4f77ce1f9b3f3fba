"""MP4 through ``omni_server.video_io`` (PyAV, libx264): fidelity by crf, the chroma-siting tag, and the encode time
of a Wan-size clip. CPU only; prints one JSON object.

    python benchmarks/video_mp4.py [--frames 81 --height 480 --width 832]

Fidelity (PSNR, dB): pixel noise compared in ``yuv420p`` (decoded planes vs the frames' own swscale conversion:
the codec's loss alone), smooth colour waves compared in RGB (the whole chain). The siting rows encode the smooth
frames with the stream tagged as H.264's default (left) instead of omni's ``chromaloc=1`` (centre, how swscale
samples), and decode with swscale's fast path instead of its accurate flags: the two choices ``video_io`` makes.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time

import numpy as np

from omni_server import video_io


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else round(10 * math.log10(255.0**2 / mse), 2)


def smooth(frames: int, height: int, width: int, period: float = 64.0) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width] * (2 * np.pi / period)
    waves = [
        np.stack([np.sin(x + t / 1.4), np.cos(y - t / 2.0), np.sin((x + y) / 1.5 + t / 1.1)], axis=-1)
        for t in range(frames)
    ]
    return (128 + 100 * np.stack(waves)).round().astype(np.uint8)


def left_sited_mp4(frames: np.ndarray, fps: int, crf: int) -> bytes:
    """``encode_mp4`` with the stream left at H.264's default chroma siting (the tag ``video_io`` sets removed)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf), "preset": "medium"}
        for index, pixels in enumerate(frames):
            frame = video_io._to_yuv420p(av, pixels)
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def fast_decode(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    args = parser.parse_args()
    noise = np.random.default_rng(0).integers(0, 256, (9, 64, 64, 3), dtype=np.uint8)
    waves = smooth(9, 64, 64)
    result: dict[str, object] = {
        "noise_yuv420p_by_crf": {
            crf: psnr(
                video_io.decode_mp4(video_io.encode_mp4(noise, 16, crf=crf), pixel_format="yuv420p").frames,
                video_io.yuv420p(noise),
            )
            for crf in (0, 10, 18, 23)
        },
        "smooth_rgb_by_crf": {
            crf: psnr(video_io.decode_mp4(video_io.encode_mp4(waves, 16, crf=crf)).frames, waves) for crf in (0, 10, 18)
        },
        "smooth_rgb_crf0_left_sited": psnr(video_io.decode_mp4(left_sited_mp4(waves, 16, 0)).frames, waves),
        "smooth_rgb_crf0_fast_decode": psnr(fast_decode(video_io.encode_mp4(waves, 16, crf=0)), waves),
    }
    clip = smooth(args.frames, args.height, args.width, period=97.0)
    for crf in (18,):
        started = time.perf_counter()
        data = video_io.encode_mp4(clip, 16, crf=crf)
        seconds = time.perf_counter() - started
        result[f"encode_{args.width}x{args.height}x{args.frames}_crf{crf}"] = {
            "seconds": round(seconds, 2),
            "ms_per_frame": round(1000 * seconds / args.frames, 1),
            "bytes": len(data),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
