"""omni-flux-shapes-tiny on the CPU: the same images through diffusers, omni, the CLI and HTTP; reordered prompts.

    python benchmarks/flux_shapes_checks.py --out DIR [--scenes 16] [--phrasing-steps 8]

1. Parity at the model's defaults (28 steps, embedded guidance 3.5, 64x64, fp32): each prompt of ``PARITY`` from
   its seed through diffusers' own ``FluxPipeline``, through ``omni_models.load(dir)`` and its ``__call__``, and
   through ``omni-server generate --model DIR`` (a subprocess writing a PNG) and through ``omni-server serve DIR``
   (one server process, ``POST /v1/images/generations`` by the official OpenAI SDK, ``seed`` in the body); PSNR
   of omni, the CLI and HTTP against diffusers (target >= 40 dB).
2. Reordered clauses: the first ``--scenes`` held-out scenes in every phrasing of
   ``benchmarks/prompt_phrasings.py`` (the published set), through omni, no prompt grammar (the family path has
   none; the model was trained on every clause order), seeds 10000 + i, default guidance.
Writes ``flux_shapes_checks.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This folder holds scripts named like the packages (fp8_cache.py, dlo_offload.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import omni_models  # noqa: E402
from omni_models.hub import WEIGHTS_ROOT  # noqa: E402
from omni_models.training import flux_shapes  # noqa: E402
from omni_models.training.scorer import adherence, read_scenes  # noqa: E402
from omni_models.training.shapes import split_scenes  # noqa: E402

PARITY = (("a red circle at the top left on a blue background", 10_000), ("on a green background, a white diamond", 7))
SIZE = flux_shapes.IMAGE_SIZE


def _prompt_phrasings():
    spec = importlib.util.spec_from_file_location("prompt_phrasings", Path(__file__).with_name("prompt_phrasings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def psnr_db(a: Image.Image, b: Image.Image) -> float | None:
    """PSNR in dB of two 8-bit images; None when they are identical (JSON has no infinity)."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return None if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def _db(value: float | None) -> str:
    return "identical" if value is None else f"{value:.2f} dB"


def cli_image(directory: Path, prompt: str, seed: int, workdir: Path) -> Image.Image:
    """``omni-server generate`` in its own process, at the model's default steps and guidance."""
    out = workdir / f"cli_{seed}.png"
    executable = shutil.which("omni-server") or str(Path(sys.executable).with_name("omni-server"))
    subprocess.run(
        [
            executable,
            "generate",
            "--model",
            str(directory),
            prompt,
            "--size",
            f"{SIZE}x{SIZE}",
            "--image-seed",
            str(seed),
            "-o",
            str(out),
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return Image.open(out).convert("RGB")


class Server:
    """``python -m omni_server serve DIRECTORY --device cpu`` in its own process session, on a free port."""

    def __init__(self, directory: Path, workdir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = workdir / "server.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "omni_server", "serve", str(directory), "--device", "cpu"]
                + ["--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready: {self.log.read_text()[-3000:]}")

    def image(self, prompt: str, seed: int) -> Image.Image:
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=600, max_retries=0)
        response = client.images.generate(
            prompt=prompt, size=f"{SIZE}x{SIZE}", response_format="b64_json", extra_body={"seed": seed}
        )
        return Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def parity(directory: Path, pipe: omni_models.FamilyPipeline) -> list[dict]:
    from diffusers import FluxPipeline

    reference = FluxPipeline.from_pretrained(str(directory), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        server = Server(directory, Path(workdir))
        try:
            server.wait()
            served = {seed: server.image(prompt, seed) for prompt, seed in PARITY}
        finally:
            server.stop()
        for prompt, seed in PARITY:
            expected = reference(
                prompt, height=SIZE, width=SIZE, generator=torch.Generator("cpu").manual_seed(seed)
            ).images[0]
            omni = pipe(prompt, seed=seed, height=SIZE, width=SIZE)[0]
            cli = cli_image(directory, prompt, seed, Path(workdir))
            rows.append(
                {
                    "prompt": prompt,
                    "seed": seed,
                    "omni_vs_diffusers_db": psnr_db(omni, expected),
                    "cli_vs_diffusers_db": psnr_db(cli, expected),
                    "http_vs_diffusers_db": psnr_db(served[seed], expected),
                }
            )
            print(
                f"{prompt!r} seed {seed}: against diffusers, omni {_db(rows[-1]['omni_vs_diffusers_db'])}, "
                f"CLI {_db(rows[-1]['cli_vs_diffusers_db'])}, HTTP {_db(rows[-1]['http_vs_diffusers_db'])}",
                flush=True,
            )
    return rows


def phrasings(pipe: omni_models.FamilyPipeline, scenes: list, steps: int) -> dict[str, dict]:
    module = _prompt_phrasings()
    results = {}
    for name, template in module.PHRASINGS.items():
        prompts = [module.phrase(template, scene) for scene in scenes]
        images = []
        for start in range(0, len(prompts), 8):
            images += pipe(
                prompts[start : start + 8], num_inference_steps=steps, seed=10_000 + start, height=SIZE, width=SIZE
            )
        results[name] = {"example": prompts[0], **adherence(read_scenes(flux_shapes.scorer_images(images)), scenes)}
        print(
            f"{name:28s} attributes {results[name]['attributes']:.4f}  shape {results[name]['shape']:.4f}  "
            f"scene {results[name]['scene']:.4f}   e.g. {prompts[0]!r}",
            flush=True,
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=WEIGHTS_ROOT / flux_shapes.NAME)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenes", type=int, default=16)
    parser.add_argument("--phrasing-steps", type=int, default=8)
    args = parser.parse_args()
    started = time.perf_counter()
    pipe = omni_models.load(str(args.model))
    record = {"model": str(args.model), "parity": parity(args.model, pipe)}
    scenes = split_scenes()[1][: args.scenes]
    record["phrasings"] = {
        "scenes": len(scenes),
        "steps": args.phrasing_steps,
        "results": phrasings(pipe, scenes, args.phrasing_steps),
    }
    record["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flux_shapes_checks.json").write_text(json.dumps(record, indent=1) + "\n")
    keys = ("omni_vs_diffusers_db", "cli_vs_diffusers_db", "http_vs_diffusers_db")
    figures = [r[key] for r in record["parity"] for key in keys]
    return 0 if all(f is None or f >= 40 for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
