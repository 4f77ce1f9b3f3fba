"""The engine's PNG encoding (``omni_server.png``) against Pillow's at the same zlib level, on this machine's CPUs.

    python benchmarks/png_encode.py [--repeats 5] [--sizes 1024 512 256] [--out results.json]

Images: a smooth one (gradients with ±2 of noise, like a trained model's output) and a noise one (what random
weights give, the worst case for deflate). For each: Pillow (``save(format="PNG", compress_level=1)``, as the
engine encoded until now), omni on one thread and omni on its default threads. Each figure is the median of
``--repeats`` encodes, with [min, max] and the file size; the ratio is Pillow's median over omni's. Every file is
decoded again and compared with the pixels.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from omni_server.engine import PNG_COMPRESS_LEVEL
from omni_server.png import default_threads, encode_png


def images(side: int) -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side]
    smooth = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], axis=-1)
    smooth = np.clip(smooth + rng.integers(-2, 3, smooth.shape), 0, 255).astype(np.uint8)
    noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    return {"smooth": Image.fromarray(smooth), "noise": Image.fromarray(noise)}


def pillow(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def timed(encode, image: Image.Image, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        data = encode(image)
        seconds.append(time.perf_counter() - start)
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    if not np.array_equal(decoded, np.asarray(image)):
        raise AssertionError("a decoded PNG differs from its pixels")
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "bytes": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512, 256])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    threads = default_threads()
    results: dict = {"threads": threads, "level": PNG_COMPRESS_LEVEL, "repeats": args.repeats, "cases": []}
    encoders = {"pillow": pillow, "omni_1_thread": lambda im: encode_png(im, threads=1), "omni": encode_png}
    print(f"PNG at zlib level {PNG_COMPRESS_LEVEL}, omni on {threads} threads, median of {args.repeats} [min, max]")
    for side in args.sizes:
        for name, image in images(side).items():
            figures = {label: timed(encode, image, args.repeats) for label, encode in encoders.items()}
            base = figures["pillow"]["median_ms"]
            cells = [
                f"{label} {f['median_ms']:.1f} [{f['min_ms']:.1f}, {f['max_ms']:.1f}] ms {f['bytes'] / 1e6:.2f} MB"
                + ("" if label == "pillow" else f" ({base / f['median_ms']:.2f}x)")
                for label, f in figures.items()
            ]
            print(f"{side}^2 {name}: " + "; ".join(cells))
            results["cases"].append({"side": side, "image": name, **figures})
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
