"""What omni-server serves, timed through HTTP, beside diffusers' own pipeline on the same weights in the same run.

    python benchmarks/serving.py --out DIR                    # FLUX.1-dev size on the GPU (random bf16 weights)
    python benchmarks/serving.py --smoke --out DIR            # tiny random FLUX.1-dev on the CPU (checks the flow)
    python benchmarks/serving.py --smoke --device cuda --out DIR   # tiny, on a GPU: compiled serving end to end
    python benchmarks/serving.py --family flux-kontext --sizes 1024 --out DIR   # edits (1024^2 in, 1024^2 out)
    python benchmarks/serving.py --family wan --out DIR       # Wan2.1-1.3B over /v1/videos, 832x480, 81 frames

1. A FLUX.1-dev-size checkpoint (``omni_models.synthetic``: the published transformer and VAE configs, CLIP-L
   whole, T5-XXL's width with ``--text-encoder-layers`` layers) is written once to ``--work-dir`` (reused when
   there), then freed from the GPU.
2. ``diffusers``: ``FluxPipeline.from_pretrained`` of that directory, eager, ``--repeats`` images per size after
   one warm-up image; then with its best compile (``transformer.compile_repeated_blocks(fullgraph=True)``) at the
   first size: first image (compile) and repeats.
3. One ``omni-server serve`` process per configuration in ``--configs`` (``default``: no flags, compiled on CUDA;
   ``fp8``: ``--quantization fp8 --fp8-cache-dir``; ``eager``: ``--enforce-eager``; ``fp8-eager``;
   ``fp8-attention``: ``fp8`` plus ``--attention-dtype fp8``): cold start
   (process start to ``/health`` 200, with an empty ``--compile-cache-dir`` and FP8 cache), then per size one
   first request, ``--repeats`` requests one at a time (median, spread, p50/p99), and ``--concurrent`` requests
   with 4 in flight (throughput against the one-at-a-time figure, p50/p99); ``/metrics`` (graphs compiled,
   recompiles since ready); then a restart over the same caches (warm start). Images are compared with
   diffusers' (PSNR, same seed).

``--family flux-kontext`` times image edits instead: the same checkpoint's components under a
``FluxKontextPipeline`` index (the FLUX.1-Kontext-dev architecture is FLUX.1-dev's), one deterministic input image
of the output's size, ``POST /v1/images/edits`` (multipart, as the OpenAI SDK sends it) against diffusers'
``FluxKontextPipeline(image=...)``. ``--request-cache JSON`` adds, per configuration, ``--repeats`` requests at the
first size with that ``cache`` field (a step-cache preset or knobs), timed like the plain ones and compared with
the plain image (PSNR), with the steps the cache computed (``usage.step_cache``).

``--family wan`` times videos: Wan2.1-T2V-1.3B's released transformer and VAE configs (UMT5-XXL's width with
``--text-encoder-layers`` layers), ``--sizes`` the widths (default 832) at ``--video-height`` (480) and
``--frames`` (81), 50 steps, guidance 5.0; a request is ``POST /v1/videos`` (JSON), polled every 50 ms until
``completed``, then ``GET /v1/videos/{id}/content``, timed from the POST to the last byte of the MP4; the MP4 is
decoded again (PyAV, ``yuv420p``) and compared with diffusers' ``WanPipeline`` frames converted to ``yuv420p`` as
the encoder converts them (PSNR: H.264's loss is in it, chroma subsampling is not). The
server needs PyAV (``--family wan`` with ``carry_wheels.sh video``, benchmarks/README.md).

Every figure lands in ``DIR/serving.json`` (written after each phase; a phase that would not finish before
``--deadline`` seconds is skipped and says so). Target lines compare each figure with its baseline of this run.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import functools
import gc
import http.client
import io
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

PROMPT = "a red fox in the snow at night"
EDIT_PROMPT = "make the fox blue"


@dataclass(frozen=True)
class Family:
    """What ``--family`` sets: diffusers' pipeline (the baseline), the ``omni_models.synthetic`` checkpoint
    written (its directory under ``--work-dir``: smoke, full size), the published guidance, the default sizes and
    steps (smoke, full), and the issue's targets for the default flags (``None``: no target)."""

    pipeline: str
    checkpoint: str
    directories: tuple[str, str]
    guidance: float
    sizes: tuple[tuple[int, ...], tuple[int, ...]]
    steps: tuple[int, int]
    seconds_target: float | None = None  # default flags, first size, end to end
    vs_eager_target: float | None = None  # default flags against diffusers eager
    fp8_seconds_target: float | None = None


FLUX_DIRECTORIES, FLUX_SIZES = ("flux-tiny", "flux-dev-size"), ((32, 64), (1024, 512, 256))
FAMILIES = {
    # FLUX.1-dev: issue 24's targets
    "flux": Family(
        "FluxPipeline",
        "flux",
        FLUX_DIRECTORIES,
        guidance=3.5,
        sizes=FLUX_SIZES,
        steps=(2, 28),
        seconds_target=3.5,
        vs_eager_target=1.45,
        fp8_seconds_target=2.5,
    ),
    # FLUX.1-Kontext-dev edits: issue 28 set no speed target
    "flux-kontext": Family(
        "FluxKontextPipeline", "flux", FLUX_DIRECTORIES, guidance=2.5, sizes=FLUX_SIZES, steps=(2, 28)
    ),
    # Wan2.1-T2V-1.3B videos: issue 29's target
    "wan": Family(
        "WanPipeline",
        "wan",
        ("wan-tiny", "wan2.1-1.3b-size"),
        guidance=5.0,
        sizes=((48,), (832,)),
        steps=(2, 50),
        vs_eager_target=1.3,
    ),
}
CONFIG_FLAGS = {
    "default": [],
    "fp8": ["--quantization", "fp8"],
    "eager": ["--enforce-eager"],
    "fp8-eager": ["--quantization", "fp8", "--enforce-eager"],
    "fp8-attention": ["--quantization", "fp8", "--attention-dtype", "fp8"],
}
# (what, figure key, baseline key, target, higher is better)
TARGETS = {
    "fp8_eager_vs_eager": 1.1,
    "psnr_db": 40.0,
    "cold_start_s": 120.0,
    "warm_start_s": 30.0,
    "concurrency": {256: 2.5, 512: 1.3, 1024: 0.97},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

    return {
        "median": statistics.median(values),
        "min": ordered[0],
        "max": ordered[-1],
        "p50": pct(50),
        "p99": pct(99),
        "n": len(values),
        "values": values,
    }


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": {}}
        self.reference: dict[int, np.ndarray] = {}

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.started)

    def save(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = time.monotonic() - self.started
        (self.args.out / "serving.json").write_text(json.dumps(self.results, indent=1, default=str))

    @property
    def edits(self) -> bool:
        return self.args.family == "flux-kontext"

    @property
    def video(self) -> bool:
        return self.args.family == "wan"

    @property
    def family(self) -> Family:
        return FAMILIES[self.args.family]

    def label(self, size: int) -> str:
        width, height = self.shape(size)
        return f"{width}x{height}x{self.args.frames}" if self.video else f"{size}^2"

    def shape(self, size: int) -> tuple[int, int]:
        """(width, height) of a request at ``size``: a square image, or a video ``size`` wide."""
        return (size, self.args.video_height) if self.video else (size, size)

    def request(self, size: int, cache: Any = None) -> dict[str, Any]:
        width, height = self.shape(size)
        body = {
            "prompt": EDIT_PROMPT if self.edits else PROMPT,
            "size": f"{width}x{height}",
            "num_inference_steps": self.args.steps,
            "guidance_scale": self.family.guidance,
            "seed": 0,
        }
        if self.video:
            body["num_frames"] = self.args.frames
        if cache is not None:
            body["cache"] = cache
        return body

    @staticmethod
    @functools.cache
    def input_png(size: int) -> bytes:
        buffer = io.BytesIO()
        Bench.input_image(size).save(buffer, format="PNG")
        return buffer.getvalue()

    @staticmethod
    def input_image(size: int) -> Any:
        """The edits' input: a deterministic smooth picture (a colour ramp with a disc) of ``size``^2."""
        from PIL import Image

        y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
        disc = ((x - 0.5) ** 2 + (y - 0.55) ** 2 < 0.06).astype(np.float32)
        rgb = np.stack([0.2 + 0.6 * x, 0.3 + 0.4 * y, 0.8 - 0.5 * x], axis=-1) * (1 - disc[..., None])
        rgb += disc[..., None] * np.array([0.9, 0.4, 0.1], dtype=np.float32)
        return Image.fromarray((rgb.clip(0, 1) * 255).astype(np.uint8))

    # --- the checkpoint ---------------------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        import torch

        from omni_models import synthetic

        directory = self.args.work_dir / self.family.directories[0 if self.args.smoke else 1]
        if (directory / "model_index.json").is_file():
            log(f"checkpoint: reusing {directory}")
            return self.kontext_index(directory) if self.edits else directory
        start = time.monotonic()
        device = torch.device(self.args.device)
        dtype = torch.float32 if self.args.smoke and device.type == "cpu" else torch.bfloat16
        if self.video:
            components = synthetic.wan_components(
                "wan2.1",
                size="tiny" if self.args.smoke else "1.3b",
                device=device,
                dtype=dtype,
                text_encoder_layers=self.args.text_encoder_layers,
                words=PROMPT.split(),
            )
            # Wan's VAE runs in float32 (its code and diffusers' examples); nn.Module.to: diffusers' .to() warns
            components["vae"] = torch.nn.Module.to(components["vae"], torch.float32)
        else:
            components = synthetic.flux_components(
                "tiny" if self.args.smoke else "full",
                guidance_embeds=True,
                device=device,
                dtype=dtype,
                text_encoder_layers=self.args.text_encoder_layers,
                words=PROMPT.split(),
            )
        built = time.monotonic() - start
        synthetic.save_checkpoint(self.family.checkpoint, components, directory, max_shard_size="5GB")
        del components
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        self.results["checkpoint"] = {"build_s": built, "write_s": time.monotonic() - start - built, "bytes": size}
        log(f"checkpoint: {size / 2**30:.1f} GiB written in {time.monotonic() - start:.0f} s")
        return self.kontext_index(directory) if self.edits else directory

    @staticmethod
    def kontext_index(flux: Path) -> Path:
        """A ``FluxKontextPipeline`` checkpoint over ``flux``'s component folders (links, no copy)."""
        directory = flux.with_name(flux.name + "-kontext")
        directory.mkdir(exist_ok=True)
        for part in flux.iterdir():
            if part.is_dir() and not (directory / part.name).exists():
                (directory / part.name).symlink_to(part.resolve(), target_is_directory=True)
        index = json.loads((flux / "model_index.json").read_text())
        index["_class_name"] = "FluxKontextPipeline"
        (directory / "model_index.json").write_text(json.dumps(index, indent=2))
        return directory

    # --- diffusers, in this process ----------------------------------------------------------------------------

    def diffusers(self, directory: Path) -> None:
        import diffusers
        import torch

        device = torch.device(self.args.device)
        dtype = torch.float32 if self.args.smoke and device.type == "cpu" else torch.bfloat16
        if self.video:  # Wan's VAE in float32, as written
            dtype = {"transformer": dtype, "text_encoder": dtype, "default": torch.float32}
        pipe = getattr(diffusers, self.family.pipeline).from_pretrained(str(directory), torch_dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)

        def image(size: int, steps: int) -> np.ndarray:
            if self.video:
                width, height = self.shape(size)
                frames = pipe(
                    prompt=PROMPT,
                    height=height,
                    width=width,
                    num_frames=self.args.frames,
                    num_inference_steps=steps,
                    guidance_scale=self.family.guidance,
                    generator=torch.Generator("cpu").manual_seed(0),
                    output_type="np",
                ).frames[0]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                from omni_models.video import Video
                from omni_server.video_io import yuv420p

                # omni's rounding to 8 bits, then the encoder's RGB-to-yuv420p conversion: what the served MP4's
                # decoded yuv420p frames compare with (chroma subsampling is not the server's error)
                return yuv420p(Video.from_float(frames, 16).frames)
            # omni draws the request's size (diffusers' max_area = that size) and resizes the reference as diffusers'
            # auto-resize does at the checkpoint's native side (the smoke's tiny checkpoint: the input's own size).
            edit = (
                {"image": self.input_image(size), "max_area": size * size, "_auto_resize": not self.args.smoke}
                if self.edits
                else {}
            )
            out = pipe(
                prompt=EDIT_PROMPT if self.edits else PROMPT,
                height=size,
                width=size,
                num_inference_steps=steps,
                guidance_scale=self.family.guidance,
                generator=torch.Generator("cpu").manual_seed(0),
                **edit,
            ).images[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            return np.asarray(out)

        def timed(size: int, repeats: int) -> dict[str, Any]:
            times = []
            for _ in range(repeats):
                start = time.monotonic()
                self.reference[size] = image(size, self.args.steps)
                times.append(time.monotonic() - start)
            return summary(times)

        phase: dict[str, Any] = {"eager": {}}
        self.results["phases"]["diffusers"] = phase
        for size in self.args.sizes:
            image(size, 2)  # warm-up
            phase["eager"][size] = timed(size, self.args.repeats)
            log(f"diffusers eager {self.label(size)}: {phase['eager'][size]['median']:.3f} s")
            self.save()
        if self.args.diffusers_compile and self.left() > 150:
            size = self.args.sizes[0]
            pipe.transformer.compile_repeated_blocks(
                fullgraph=True, backend="inductor" if device.type == "cuda" else "eager"
            )
            start = time.monotonic()
            image(size, self.args.steps)
            phase["compiled"] = {"first_image_s": time.monotonic() - start, size: timed(size, self.args.repeats)}
            log(f"diffusers compiled {self.label(size)}: {phase['compiled'][size]['median']:.3f} s")
        for part in ("transformer", "vae", "text_encoder", "text_encoder_2"):  # free the GPU memory
            if hasattr(pipe, part):
                setattr(pipe, part, None)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.save()

    # --- omni-server, a real process ---------------------------------------------------------------------------

    def start_server(self, directory: Path, name: str, caches: Path) -> tuple[subprocess.Popen, int, float]:
        flags = CONFIG_FLAGS[name]
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "omni_server",
            "serve",
            str(directory),
            "--device",
            self.args.device,
            "--port",
            str(port),
            "--log-level",
            "info",
            *flags,
            *shlex.split(self.args.server_args),
        ]
        if "--enforce-eager" not in flags and self.args.device.startswith("cuda"):
            command += ["--compile-cache-dir", str(caches / "compile")]
        if "fp8" in flags:
            command += ["--fp8-cache-dir", str(caches / "fp8")]
        if self.video:
            command += ["--video-dir", str(caches / "videos")]
        log_file = open(self.args.out / f"server-{name}.log", "ab")  # noqa: SIM115
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = start + self.args.start_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode} during start ({' '.join(flags)})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return process, port, time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.25)
        self.stop_server(process)
        raise RuntimeError(f"server not ready within {self.args.start_timeout} s")

    @staticmethod
    def stop_server(process: subprocess.Popen) -> None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def post(self, port: int, body: dict[str, Any]) -> tuple[float, np.ndarray, dict[str, Any]]:
        """One request: a JSON generation, or (``--family flux-kontext``) a multipart edit of ``input_image``,
        encoded by httpx as the OpenAI SDK sends it; returns the seconds, the image and the response's ``usage``."""
        import httpx
        from PIL import Image

        if self.video:
            return self.post_video(port, body)
        if self.edits:
            fields = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in body.items()}
            image = ("in.png", self.input_png(int(body["size"].split("x")[0])), "image/png")
            form = httpx.Request("POST", "http://omni/v1/images/edits", data=fields, files={"image": image})
            payload, path, headers = form.read(), "/v1/images/edits", {"Content-Type": form.headers["Content-Type"]}
        else:
            payload = json.dumps(body).encode()
            path, headers = "/v1/images/generations", {"Content-Type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start = time.monotonic()
        conn.request("POST", path, payload, headers)
        response = conn.getresponse()
        data = response.read()
        elapsed = time.monotonic() - start
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
        answer = json.loads(data)
        png = base64.b64decode(answer["data"][0]["b64_json"])
        return elapsed, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), answer.get("usage") or {}

    @staticmethod
    def post_video(port: int, body: dict[str, Any]) -> tuple[float, np.ndarray, dict[str, Any]]:
        """``POST /v1/videos``, ``GET /v1/videos/{id}`` every 50 ms until it ends, then its MP4: the seconds from
        the POST to the MP4's last byte, the decoded frames (``yuv420p``, PyAV's planar ``(T, H * 3 // 2, W)``),
        and the finished Video object."""
        from omni_server.video_io import decode_mp4

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def call(method: str, path: str, payload: bytes | None = None) -> bytes:
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, payload, headers)
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {response.status}: {data[:300]!r}")
            return data

        start = time.monotonic()
        video = json.loads(call("POST", "/v1/videos", json.dumps(body).encode()))
        while video["status"] not in ("completed", "failed"):
            time.sleep(0.05)
            video = json.loads(call("GET", f"/v1/videos/{video['id']}"))
        if video["status"] == "failed":
            raise RuntimeError(f"video {video['id']} failed: {video.get('error')}")
        mp4 = call("GET", f"/v1/videos/{video['id']}/content")
        elapsed = time.monotonic() - start
        call("DELETE", f"/v1/videos/{video['id']}")
        return elapsed, decode_mp4(mp4, pixel_format="yuv420p").frames, video

    @staticmethod
    def metrics(port: int) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        wanted = ("omni:compiled_graphs", "omni:recompiles_since_ready")
        values = {}
        for line in text.splitlines():
            for name in wanted:
                if line.startswith(name + "{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        return values

    def serve(self, directory: Path, name: str) -> None:
        flags = CONFIG_FLAGS[name]
        caches = Path(tempfile.mkdtemp(prefix=f"serving-{name}-", dir=self.args.work_dir))
        phase: dict[str, Any] = {"flags": flags, "sizes": {}}
        self.results["phases"][f"omni_{name}"] = phase
        try:
            process, port, cold = self.start_server(directory, name, caches)
            phase["cold_start_s"] = cold
            log(f"omni {name}: cold start {cold:.1f} s")
            try:
                phase["metrics_at_ready"] = self.metrics(port)
                for size in self.args.sizes:
                    entry: dict[str, Any] = {}
                    entry["first_request_s"], entry["serial"], pixels, _ = self.series(port, self.request(size))
                    if size in self.reference and pixels is not None:
                        entry["psnr_vs_diffusers_db"] = psnr(pixels, self.reference[size])
                    if self.args.request_cache is not None and size == self.args.sizes[0] and pixels is not None:
                        entry["step_cache"] = self.cached_series(port, size, pixels)
                    if self.args.concurrent:
                        with concurrent.futures.ThreadPoolExecutor(4) as pool:
                            start = time.monotonic()
                            latencies = [
                                f.result()[0]
                                for f in [
                                    pool.submit(self.post, port, self.request(size))
                                    for _ in range(self.args.concurrent)
                                ]
                            ]
                            wall = time.monotonic() - start
                        entry["concurrency_4"] = summary(latencies)
                        entry["concurrency_4"]["wall_s"] = wall
                        entry["throughput_ratio"] = (self.args.concurrent / wall) / (1 / entry["serial"]["median"])
                    phase["sizes"][size] = entry
                    log(
                        f"omni {name} {self.label(size)}: {entry['serial']['median']:.3f} s "
                        f"(first {entry['first_request_s']:.2f} s), x4 throughput "
                        f"{entry.get('throughput_ratio', float('nan')):.2f}, "
                        f"PSNR {entry.get('psnr_vs_diffusers_db', float('nan')):.1f} dB"
                    )
                    self.save()
                phase["metrics_after"] = self.metrics(port)
            finally:
                self.stop_server(process)
            if self.args.warm_start and self.left() > 90:
                process, port, warm = self.start_server(directory, name, caches)
                phase["warm_start_s"] = warm
                log(f"omni {name}: warm start {warm:.1f} s")
                try:
                    phase["warm_first_request_s"] = self.post(port, self.request(self.args.sizes[0]))[0]
                    phase["warm_metrics"] = self.metrics(port)
                finally:
                    self.stop_server(process)
        except Exception as exc:
            phase["error"] = f"{type(exc).__name__}: {exc}"
            log(f"omni {name}: FAILED {phase['error']}")
        finally:
            shutil.rmtree(caches, ignore_errors=True)
            self.save()

    def series(self, port: int, body: dict[str, Any]) -> tuple[float, dict[str, Any], np.ndarray | None, dict]:
        """One first request, then ``--repeats`` one at a time: the first's seconds, the repeats' summary, and the
        last image and ``usage``. Each request's seconds are logged as it ends, so that a run killed part way keeps
        them; the repeats stop at ``--deadline`` (the summary then says how many ran)."""
        first = self.post(port, body)[0]
        log(f"  request: first {first:.3f} s")
        times, pixels, usage = [], None, {}
        for _ in range(self.args.repeats):
            if times and self.left() < 0:
                log(f"  repeats: {len(times)} of {self.args.repeats} before --deadline")
                break
            elapsed, pixels, usage = self.post(port, body)
            times.append(elapsed)
            log(f"  request: {elapsed:.3f} s")
        return first, summary(times), pixels, usage

    def cached_series(self, port: int, size: int, plain: np.ndarray) -> dict[str, Any]:
        """``--repeats`` requests with ``--request-cache`` after one first request, against the plain ones."""
        _, serial, pixels, usage = self.series(port, self.request(size, cache=self.args.request_cache))
        out = {"cache": self.args.request_cache, "serial": serial, "psnr_vs_uncached_db": psnr(pixels, plain)}
        out["usage_step_cache"] = usage.get("step_cache")
        log(f"  with cache: {out['serial']['median']:.3f} s, PSNR vs uncached {out['psnr_vs_uncached_db']:.1f} dB")
        return out

    # --- the run -----------------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Import what a server process imports (its web stack, diffusers), in a child with this environment,
        before minutes go into the checkpoint and the baseline: a missing wheel is named at once."""
        probe = (
            f"import omni_server.api, omni_server.serve, diffusers, httpx, uvicorn; diffusers.{self.family.pipeline}"
        )
        if self.video:
            probe += "; import av"
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ.copy())
        if result.returncode != 0:
            raise SystemExit(f"a server could not start here: {result.stderr.strip().splitlines()[-1]}")

    def run(self) -> None:
        import torch

        self.results["device"] = torch.cuda.get_device_name() if self.args.device.startswith("cuda") else "cpu"
        self.results["family"] = self.args.family
        self.preflight()
        self.results["torch"] = torch.__version__
        directory = self.checkpoint()
        self.save()
        order = ["diffusers"] + list(self.args.configs)
        # The smallest time each phase needs to be worth starting (full size; the smoke run needs far less).
        needs = {"diffusers": 60, "default": 150, "fp8": 150, "eager": 60, "fp8-eager": 60, "fp8-attention": 150}
        for phase in order:
            if self.left() < (5 if self.args.smoke else needs[phase]):
                self.results["phases"][phase] = {"skipped": f"{self.left():.0f} s left of --deadline"}
                log(f"{phase}: skipped ({self.left():.0f} s left)")
                continue
            if phase == "diffusers":
                if self.args.baseline:
                    self.diffusers(directory)
            else:
                self.serve(directory, phase)
        self.report()

    def report(self) -> None:
        phases = self.results["phases"]
        lines = []
        first = self.args.sizes[0]

        def serial(name: str, size: int) -> float | None:
            entry = phases.get(name, {}).get("sizes", {}).get(size)
            return entry["serial"]["median"] if entry else None

        eager_ref = phases.get("diffusers", {}).get("eager", {}).get(first, {}).get("median")
        default = serial("omni_default", first)
        if default is not None:
            lines.append((f"default flags {self.label(first)} end to end (s, <=)", default, self.family.seconds_target))
            if eager_ref:
                lines.append(("default vs diffusers eager (x, >=)", eager_ref / default, self.family.vs_eager_target))
            compiled_ref = phases.get("diffusers", {}).get("compiled", {}).get(first, {}).get("median")
            if compiled_ref:
                lines.append(("default vs diffusers compiled (x)", compiled_ref / default, None))
        fp8 = serial("omni_fp8", first)
        if fp8 is not None:
            target = self.family.fp8_seconds_target
            lines.append((f"--quantization fp8 {self.label(first)} end to end (s, <=)", fp8, target))
        fp8_attention = serial("omni_fp8-attention", first)
        if fp8_attention is not None:
            lines.append((f"+ --attention-dtype fp8 {self.label(first)} end to end (s)", fp8_attention, None))
            if fp8 is not None:
                lines.append(("FP8 attention vs bf16 attention, both with FP8 linears (x)", fp8 / fp8_attention, None))
        eager, fp8_eager = serial("omni_eager", first), serial("omni_fp8-eager", first)
        if eager and fp8_eager:
            lines.append(("FP8 eager vs bf16 eager (x, >=)", eager / fp8_eager, TARGETS["fp8_eager_vs_eager"]))
        if eager and eager_ref:
            lines.append(("omni eager vs diffusers eager (x)", eager_ref / eager, None))
        for name in ("omni_default", "omni_fp8", "omni_eager", "omni_fp8-eager", "omni_fp8-attention"):
            phase = phases.get(name, {})
            for key, target in (("cold_start_s", TARGETS["cold_start_s"]), ("warm_start_s", TARGETS["warm_start_s"])):
                if key in phase:
                    lines.append((f"{name} {key} (<=)", phase[key], target))
            for size, entry in phase.get("sizes", {}).items():
                if "throughput_ratio" in entry and name == "omni_default":
                    lines.append(
                        (
                            f"{name} {self.label(size)} 4 concurrent throughput (x, >=)",
                            entry["throughput_ratio"],
                            TARGETS["concurrency"].get(size),
                        )
                    )
                if "psnr_vs_diffusers_db" in entry and name in ("omni_default", "omni_eager"):
                    lines.append(
                        (
                            f"{name} {self.label(size)} PSNR vs diffusers (dB, >=)",
                            entry["psnr_vs_diffusers_db"],
                            TARGETS["psnr_db"],
                        )
                    )
            cached = phase.get("sizes", {}).get(first, {}).get("step_cache")
            if cached:
                plain = phase["sizes"][first]["serial"]["median"]
                lines.append((f"{name} {self.label(first)} with the step cache (s)", cached["serial"]["median"], None))
                lines.append((f"{name} step cache vs none, end to end (x)", plain / cached["serial"]["median"], None))
            if "metrics_after" in phase:
                lines.append(
                    (f"{name} recompiles since ready", phase["metrics_after"].get("omni:recompiles_since_ready", -1), 0)
                )
        self.results["report"] = [{"what": w, "value": v, "target": t} for w, v, t in lines]
        self.save()
        print("\nserving benchmark", self.results["device"])
        for what, value, target in lines:
            print(f"  {what}: {value:.3f}" + ("" if target is None else f" (target {target})"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--family", choices=tuple(FAMILIES), default="flux", help="flux-kontext: image edits; wan: videos"
    )
    parser.add_argument("--video-height", type=int, default=None, help="wan: default 480 (smoke: 32)")
    parser.add_argument("--frames", type=int, default=None, help="wan: default 81 (smoke: 5)")
    parser.add_argument("--request-cache", type=json.loads, default=None, help="a step cache (JSON) to time too")
    parser.add_argument("--smoke", action="store_true", help="a tiny random checkpoint, 2 steps")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="default: FLUX.1 1024 512 256 (smoke: 32 64), Wan 832 (48)"
    )
    parser.add_argument("--steps", type=int, default=None, help="default: FLUX.1 28, Wan 50 (smoke: 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=4, help="requests sent with 4 in flight; 0: none")
    parser.add_argument("--configs", nargs="+", default=["default", "fp8", "fp8-eager", "eager"], choices=CONFIG_FLAGS)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--diffusers-compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True, help="restart, time it")
    parser.add_argument("--text-encoder-layers", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=400.0)
    parser.add_argument("--server-args", default="", help='more flags for every server, e.g. "--video-crf 10"')
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds the whole run may take")
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    family, full = FAMILIES[args.family], int(not args.smoke)
    args.video_height = args.video_height or (32 if args.smoke else 480)
    args.frames = args.frames or (5 if args.smoke else 81)
    args.sizes = args.sizes or list(family.sizes[full])
    args.steps = args.steps or family.steps[full]
    args.out.mkdir(parents=True, exist_ok=True)
    Bench(args).run()


if __name__ == "__main__":
    main()
