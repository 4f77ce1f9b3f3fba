"""Real families on one GPU: omni against diffusers' own pipeline, same weights, same seed, same run.

    python benchmarks/real_models.py --family flux --out DIR        # FLUX.1-dev, 1024^2, 28 steps
    python benchmarks/real_models.py --family qwen-image --out DIR  # Qwen-Image, 1024^2, 50 steps, true CFG
    python benchmarks/real_models.py --family flux --smoke --out DIR  # everything at tiny sizes on the CPU

Weights are random (``omni_models.synthetic``): the transformers and VAEs have the published full-size configs
and are built on the meta device, then filled on the GPU; the text encoders keep their width but have
``--text-encoder-layers`` layers (CLIP-L is whole). Phases, in this order (each reports the transformer's
ms/step, the sum of its forwards per denoising step, and end-to-end seconds per image including text encoding
and VAE decode; medians with min/max):

- ``diffusers``: diffusers' ``FluxPipeline`` / ``QwenImagePipeline``, eager;
- ``omni``: ``omni_models.build_family_pipeline`` over the same modules (omni's attention processors), eager;
  its images are compared with diffusers' (PSNR) as a parity check on the GPU;
- ``concurrency``: 4 requests with different prompts through the stepwise batched API, one after another vs.
  all at once (one forward per step for all of them); throughput ratio and request-latency p50/p99 (all
  submitted at t=0);
- ``engine``: the same 4 requests through omni-server's engine (``omni_server.engine.EngineCore`` with the
  families' batched strategy, in this process: admission, text encoders once per request, one batched step for
  every running request, batched VAE decode, PNG encoding), served one after another vs. all submitted at once;
  throughput ratio and request-latency p50/p99 (all submitted at t=0). Needs ``omni-server`` importable (its
  engine needs msgspec and pydantic, not vLLM, FastAPI or uvicorn);
- ``fp8``: omni with FP8 linears (fp8_cache, the family's ignore list), eager. With ``--fp8-source cache``
  (default) the bf16 transformer is written to ``--work-dir`` as safetensors, the FP8 cache built from it
  (cold), and the timed pipeline loads its transformer from the warm cache; when the work dir lacks space for
  that, a copy of the transformer is quantized online and the JSON says why. PSNR/SSIM against omni bf16;
- ``offload``: omni with layerwise offload (dlo_offload over the family's block lists: resident parts + 2 block
  slots on the device), time vs. resident, device weight bytes, and whether the image equals the resident one;
- ``compiled``: diffusers with ``transformer.compile_repeated_blocks()`` and omni with ``compile_transformer()``
  (both regional ``torch.compile`` of the repeated blocks).
- ``fp8_compiled`` (with ``fp8``): the FP8 transformer under the same regional compile, once per activation
  scaling in ``--fp8-compiled-scaling`` (inductor fuses the activation quantization into the op before each
  linear); compared with omni bf16 compiled.
- ``step_cache`` (issue 26): one request at a time through the stepwise API (what the engine drives) with each
  step cache, ``--step-cache-repeats`` images each after a warm-up: the denoising loop's wall time (and end to
  end) against the same run's uncached requests. Configs: ``off``, the ``safe`` and ``fast`` presets (their
  residual test decides on these random weights, so their computed fraction is whatever it is here), and
  ``fast_mask``, a static mask of the steps ``fast`` computed on the trained omni-flux-shapes-tiny at 28 steps
  (``FAST_ON_TRAINED``): the wall time at the computed-step fraction the issue's target names. With
  ``--step-cache-compiled`` the blocks are then compiled as serving compiles them and ``off`` and ``fast_mask``
  run again (``--deadline`` permitting);
- ``offload_batched`` (with ``offload``): 4 requests denoised together, resident vs. offloaded. At batch 1 a
  full-size family's block bytes take longer to cross PCIe than its blocks take to compute, so the offload
  phase also times a plain pinned host-to-device copy of one slot in the same run and reports the copy-bound
  floor (host bytes / that bandwidth) next to the resident time.

``--baseline none`` skips diffusers (eager and compiled) for a shorter run that re-measures omni's own phases.

Ratios are printed against the targets (omni bf16 >= 1.0x diffusers, eager and compiled; FP8 >= 1.3x omni bf16;
offload <= 1.10x resident; concurrency and engine >= 1.3x) and every number lands in ``DIR/real_models_<family>.json``.
Needs diffusers (not in the GPU image: carry its wheel, see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Scripts beside this one are named like the libraries (fp8_cache.py, dlo_offload.py): drop this directory from
# the import path so that the libraries, not those scripts, are imported.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PROMPTS = [
    "a red fox in the snow at night",
    "a photo of a green city at the top of a forest",
    "a blue square on a white background",
    "a black cat on the left of an orange circle",
]
NEGATIVE = "blurry, bad quality"
FULL = {
    "flux": dict(size=1024, steps=28, guidance_scale=3.5, true_cfg_scale=1.0, negative_prompt=None),
    "qwen-image": dict(size=1024, steps=50, guidance_scale=None, true_cfg_scale=4.0, negative_prompt=NEGATIVE),
}
TARGETS = {
    "omni_vs_diffusers_eager": 1.0,
    "omni_vs_diffusers_compiled": 1.0,
    "fp8_vs_bf16": 1.3,
    "offload_vs_resident_max": 1.10,
    "concurrency_throughput": 1.3,
}
BATCHED_REQUESTS = 4
# The steps the ``fast`` preset computed on the trained omni-flux-shapes-tiny, 28 steps (every image of
# benchmarks/results/2026-12-02/step-cache/composition.json: CCSSSCSSCSSSCSSSCSSSCSSSCSSC, 9 of 28).
# At 50 steps (Qwen-Image's default; benchmarks/results/2026-12-02g/composition_50_steps.json, the same 4 scenes):
# two patterns, 15 of 50 steps each; this is the second scenes' (CCSCSSSC...SSSCSC).
FAST_ON_TRAINED = {
    ("flux", 28): [0, 1, 5, 8, 12, 16, 20, 24, 27],
    ("qwen-image", 50): [0, 1, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 49],
}
STEP_CACHE_SPEEDUP_TARGET = 1.8


def diffusers_family(name: str) -> Any:
    """The ``DiffusersFamily`` registered as ``name`` (its backend module's ``FAMILY``)."""
    from omni_models.registry import KINDS

    return next(kind for kind in KINDS if kind.name == name).module().FAMILY


def require_diffusers() -> None:
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        sys.exit(
            f"real_models.py needs diffusers and transformers ({exc}); carry the wheels listed in "
            "benchmarks/README.md ('Real families') and put them on PYTHONPATH"
        )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


class ForwardTimer:
    """Wall time of every transformer forward (device-synchronised), grouped per denoising step by the caller."""

    def __init__(self, transformer: torch.nn.Module, device: torch.device) -> None:
        self.device, self.times, self._start = device, [], 0.0
        self._handles = [
            transformer.register_forward_pre_hook(self._pre),
            transformer.register_forward_hook(self._post),
        ]

    def _pre(self, module: Any, args: Any) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        synchronize(self.device)
        self.times.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def pinned_copy_bandwidth(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """Bytes/s of a plain ``copy_`` from pinned host memory to ``device`` (the floor any weight streaming meets)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(host, non_blocking=True)
    synchronize(device)
    return repeats * nbytes / (time.perf_counter() - start)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM over RGB channels (11x11 Gaussian window, sigma 1.5, the usual constants for 8-bit images)."""
    x = torch.from_numpy(np.array(a)).permute(2, 0, 1).unsqueeze(1).double()
    y = torch.from_numpy(np.array(b)).permute(2, 0, 1).unsqueeze(1).double()
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    window = (g / g.sum()).outer(g / g.sum())[None, None]
    mu_x, mu_y = F.conv2d(x, window), F.conv2d(y, window)
    var_x = F.conv2d(x * x, window) - mu_x**2
    var_y = F.conv2d(y * y, window) - mu_y**2
    cov = F.conv2d(x * y, window) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    value = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(value.mean())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.request = dict(FULL[args.family])
        if args.smoke:
            self.request.update(size=32, steps=3)
        if args.steps:
            self.request["steps"] = args.steps
        self.results: dict[str, Any] = {"family": args.family, "request": dict(self.request), "phases": {}}
        self.started = time.perf_counter()
        self.seed = 1234

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f}s] {message}", flush=True)

    # --- one image, timed ----------------------------------------------------------------------------------------

    def _diffusers_call(self, pipe: Any, prompt: str, steps: int) -> Any:
        r = self.request
        kwargs = dict(
            prompt=prompt,
            num_inference_steps=steps,
            height=r["size"],
            width=r["size"],
            true_cfg_scale=r["true_cfg_scale"],
            negative_prompt=r["negative_prompt"],
            generator=torch.Generator("cpu").manual_seed(self.seed),
        )
        if r["guidance_scale"] is not None:
            kwargs["guidance_scale"] = r["guidance_scale"]
        return pipe(**kwargs).images[0]

    def _omni_call(self, pipe: Any, prompt: str, steps: int) -> Any:
        r = self.request
        return pipe(
            prompt,
            negative_prompt=r["negative_prompt"],
            num_inference_steps=steps,
            guidance_scale=r["guidance_scale"],
            true_cfg_scale=r["true_cfg_scale"],
            seed=self.seed,
            height=r["size"],
            width=r["size"],
        )[0]

    def timed(
        self,
        name: str,
        call: Callable[[Any, str, int], Any],
        pipe: Any,
        transformer: torch.nn.Module,
        repeats: int,
        forwards_per_step: int,
    ) -> np.ndarray:
        """Warm up (2 steps), then ``repeats`` full images: e2e seconds and transformer ms/step."""
        steps = self.request["steps"]
        call(pipe, PROMPTS[0], min(2, steps))
        synchronize(self.device)
        timer = ForwardTimer(transformer, self.device)
        e2e, image = [], None
        try:
            for _ in range(repeats):
                synchronize(self.device)
                start = time.perf_counter()
                image = call(pipe, PROMPTS[0], steps)
                synchronize(self.device)
                e2e.append(time.perf_counter() - start)
        finally:
            timer.remove()
        per_step = [
            1e3 * sum(timer.times[i : i + forwards_per_step]) for i in range(0, len(timer.times), forwards_per_step)
        ]
        pixels = np.asarray(image)
        self.results["phases"][name] = {
            "ms_per_step": summary(per_step),
            "e2e_s": summary(e2e),
            "finite": bool(np.isfinite(pixels).all()),
            "pixel_std": float(pixels.std()),
        }
        self.log(
            f"{name}: {statistics.median(per_step):.1f} ms/step, {statistics.median(e2e):.2f} s/image (n={repeats})"
        )
        return pixels

    # --- phases --------------------------------------------------------------------------------------------------

    def build(self) -> dict[str, Any]:
        from omni_models import synthetic

        build = synthetic.flux_components if self.args.family == "flux" else synthetic.qwen_image_components
        start = time.perf_counter()
        components = build(
            "tiny" if self.args.smoke else "full",
            device=self.device,
            dtype=self.dtype,
            text_encoder_layers=self.args.text_encoder_layers,
            words=" ".join(PROMPTS).split(),
        )
        synchronize(self.device)
        transformer = components["transformer"]
        self.results["build_s"] = time.perf_counter() - start
        self.results["transformer_params"] = sum(p.numel() for p in transformer.parameters())
        self.results["text_encoders"] = (
            "full CLIP-L; T5-XXL width with %d layers"
            if self.args.family == "flux"
            else "Qwen2.5-VL-7B text width with %d layers, 1-block vision tower"
        ) % self.args.text_encoder_layers
        self.log(
            f"built {self.args.family}: transformer {self.results['transformer_params'] / 1e9:.2f}B params, "
            f"text encoders reduced ({self.results['text_encoders']})"
        )
        return components

    def forwards_per_step(self, omni: bool) -> int:
        guided = self.request["negative_prompt"] is not None and self.request["true_cfg_scale"] > 1
        return 2 if guided and not omni else 1  # diffusers runs cond and uncond separately; omni batches them

    def _prepare(self, pipe: Any, index: int, steps: int, cache: Any = None) -> list:
        from omni_models import GenerationRequest, resolve_request

        r = self.request
        request = GenerationRequest(
            prompt=PROMPTS[index % len(PROMPTS)],
            negative_prompt=r["negative_prompt"],
            num_inference_steps=steps,
            guidance_scale=r["guidance_scale"],
            true_cfg_scale=r["true_cfg_scale"],
            seed=self.seed + index,
            height=r["size"],
            width=r["size"],
            cache=cache,
        )
        return pipe.prepare(resolve_request(pipe.info, request))

    def _serve(self, pipe: Any, batches: list[list]) -> float:
        """Run the jobs of ``batches`` together (one forward per step for all); returns the completion time."""
        jobs = [job for batch in batches for job in batch]
        pipe.start(jobs)
        while not all(job.finished for job in jobs):
            pipe.step([job for job in jobs if not job.finished])
        pipe.decode(jobs)
        synchronize(self.device)
        return time.perf_counter()

    def _serve_together_s(self, pipe: Any, count: int, steps: int) -> float:
        """Seconds for ``count`` requests of ``steps`` steps denoised together (after one warm-up at that shape)."""
        self._serve(pipe, [self._prepare(pipe, i, min(2, steps)) for i in range(count)])
        start = time.perf_counter()
        self._serve(pipe, [self._prepare(pipe, i, steps) for i in range(count)])
        return time.perf_counter() - start

    def _record_throughput(
        self, phase: str, steps: int, sequential: list[float], concurrent: list[float], **extra: Any
    ) -> None:
        """Store and log one phase of 4 requests: each request's finish time (s since its run's start), served one
        after another and all at once; throughput is the ratio of the two runs' last finishes."""
        ratio = max(sequential) / max(concurrent)

        def latency(values: list[float]) -> dict[str, float]:
            return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}

        self.results["phases"][phase] = {
            "steps": steps,
            "requests": len(sequential),
            **extra,
            "sequential_total_s": max(sequential),
            "concurrent_total_s": max(concurrent),
            "throughput_ratio": ratio,
            "sequential_latency_s": latency(sequential),
            "concurrent_latency_s": latency(concurrent),
        }
        self.log(
            f"{phase}: {len(sequential)} requests x {steps} steps: {max(sequential):.2f} s one after another, "
            f"{max(concurrent):.2f} s together -> {ratio:.2f}x throughput; latency p50/p99 "
            f"{np.percentile(sequential, 50):.2f}/{np.percentile(sequential, 99):.2f} s vs "
            f"{np.percentile(concurrent, 50):.2f}/{np.percentile(concurrent, 99):.2f} s"
        )

    def concurrency(self, pipe: Any) -> None:
        steps = self.args.concurrency_steps or self.request["steps"]
        self._serve(pipe, [self._prepare(pipe, 0, steps)])  # warm-up at this batch shape's sizes
        t0 = time.perf_counter()
        sequential = [self._serve(pipe, [self._prepare(pipe, i, steps)]) - t0 for i in range(4)]
        t1 = time.perf_counter()
        finished = self._serve(pipe, [self._prepare(pipe, i, steps) for i in range(4)]) - t1
        self._record_throughput("concurrency", steps, sequential, [finished] * 4)

    def engine(self, pipe: Any) -> None:
        """4 requests through omni-server's engine: one after another, then all at once."""
        from omni_models import GenerationRequest, resolve_request
        from omni_server.config import build_config
        from omni_server.engine import EngineCore
        from omni_server.protocol import RequestFinished

        r, steps = self.request, self.args.concurrency_steps or self.request["steps"]
        config = build_config(
            None, model=f"random-{self.args.family}", device=str(self.device), warmup=False, max_num_seqs=4
        )
        engine = EngineCore(pipe, config)
        cfg = r["true_cfg_scale"] if r["negative_prompt"] is not None else None

        def request(index: int) -> Any:
            return resolve_request(
                engine.info,
                GenerationRequest(
                    prompt=PROMPTS[index],
                    negative_prompt=r["negative_prompt"],
                    num_inference_steps=steps,
                    guidance_scale=r["guidance_scale"],
                    true_cfg_scale=cfg,
                    height=r["size"],
                    width=r["size"],
                    seed=self.seed + index,
                ),
            )

        def serve(indices: list[int], t0: float) -> list[float]:
            """Add the requests, run the engine until each finished; seconds from ``t0`` to each finish."""
            for i in indices:
                engine.add(f"r{i}", request(i))
            done: dict[str, float] = {}
            while len(done) < len(indices):
                for output in engine.step():
                    if isinstance(output, RequestFinished):
                        if output.error is not None:
                            raise RuntimeError(f"engine request {output.request_id} failed: {output.error.message}")
                        synchronize(self.device)
                        done[output.request_id] = time.perf_counter() - t0
            return [done[f"r{i}"] for i in indices]

        serve([0], time.perf_counter())  # warm-up at this shape
        synchronize(self.device)
        t0 = time.perf_counter()
        sequential = [serve([i], t0)[0] for i in range(4)]
        synchronize(self.device)
        concurrent = serve(list(range(4)), time.perf_counter())
        self._record_throughput(
            "engine", steps, sequential, concurrent, engine="omni_server.engine.EngineCore (in process)"
        )
        engine.close()

    def offload(self, components: dict[str, Any], build: Callable[..., Any], resident_pixels: np.ndarray) -> None:
        """Offload the resident transformer in place (its block bytes are packed straight from the device into
        pinned host buffers), time it, then put it back on the device."""
        from dlo_offload import enable_layerwise_offload
        from omni_models.integrations import family_offload_plan

        transformer = components["transformer"]
        transformer_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
        batched_steps = self.args.offload_batched_steps
        resident_batched_s = None
        if "offload_batched" in self.args.phases:
            resident_batched_s = self._serve_together_s(build(components), BATCHED_REQUESTS, batched_steps)
            self.log(
                f"resident: {BATCHED_REQUESTS} requests x {batched_steps} steps together in {resident_batched_s:.2f} s"
            )
        synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        start = time.perf_counter()
        plan = family_offload_plan(diffusers_family(self.args.family).declaration, self.args.offload_resident_blocks)
        handle = enable_layerwise_offload(transformer, plan, device=self.device, use_allgather=False)
        enable_s = time.perf_counter() - start
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        after = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        pipe = build(components, offload=handle)
        pixels = self.timed(
            "offload", self._omni_call, pipe, transformer, self.args.repeats, self.forwards_per_step(True)
        )
        phase = self.results["phases"]["offload"]
        phase.update(
            enable_s=enable_s,
            resident_blocks=self.args.offload_resident_blocks,
            slot_bytes=handle.slot_nbytes,
            resident_bytes=handle.resident_nbytes,
            host_bytes=handle.host_nbytes,
            pinned=handle.pinned,
            transformer_bytes=transformer_bytes,
            device_weight_bytes_expected=handle.resident_nbytes + 2 * handle.slot_nbytes,
            pixels_equal_resident=bool(np.array_equal(pixels, resident_pixels)),
        )
        if self.device.type == "cuda":
            phase["device_weight_bytes_measured"] = after - (before - transformer_bytes)
            bandwidth = pinned_copy_bandwidth(handle.slot_nbytes, self.device)
            forwards = self.forwards_per_step(True)
            phase.update(
                pinned_copy_gb_s=bandwidth / 1e9, copy_bound_ms_per_step=1e3 * forwards * handle.host_nbytes / bandwidth
            )
            self.log(
                f"offload: a plain pinned copy runs at {bandwidth / 1e9:.1f} GB/s, so streaming "
                f"{handle.host_nbytes / 2**30:.1f} GiB per forward takes at least "
                f"{phase['copy_bound_ms_per_step']:.1f} ms/step"
            )
        self.log(
            f"offload: device weights {phase['device_weight_bytes_expected'] / 2**20:.1f} MiB "
            f"(resident parts + 2 slots) of {transformer_bytes / 2**20:.1f} MiB; image equals resident: "
            f"{phase['pixels_equal_resident']}"
        )
        if resident_batched_s is not None:
            offload_batched_s = self._serve_together_s(pipe, BATCHED_REQUESTS, batched_steps)
            phase["batched"] = {
                "requests": BATCHED_REQUESTS,
                "steps": batched_steps,
                "resident_s": resident_batched_s,
                "offload_s": offload_batched_s,
                "ratio": offload_batched_s / resident_batched_s,
            }
            self.log(
                f"offload: {BATCHED_REQUESTS} requests together {offload_batched_s:.2f} s vs resident "
                f"{resident_batched_s:.2f} s -> {offload_batched_s / resident_batched_s:.3f}x"
            )
        handle.remove()  # streamed blocks come back to the host
        transformer.to(self.device)

    def fp8(self, components: dict[str, Any], build: Callable[..., Any], bf16_pixels: np.ndarray) -> None:
        from omni_models.diffusers_adapter import load_fp8_transformer_component
        from omni_models.integrations import quantize_family_fp8

        transformer = components["transformer"]
        work = Path(tempfile.mkdtemp(prefix="real_models_", dir=self.args.work_dir))
        bf16_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
        needed = int(bf16_bytes * 1.6)  # the bf16 shards plus the FP8 artifact, with room
        free = shutil.disk_usage(work).free
        source = self.args.fp8_source
        if source == "cache" and free < needed:
            source = (
                f"online (work dir {work.parent} has {free / 2**30:.0f} GiB free; the cache path needs "
                f"{needed / 2**30:.0f} GiB)"
            )
        phase: dict[str, Any] = {"source": source}
        try:
            if source == "cache":
                start = time.perf_counter()
                transformer.save_pretrained(str(work / "transformer"), max_shard_size="5GB")
                phase["save_bf16_s"] = time.perf_counter() - start
                timings = {}
                for attempt in ("cold", "warm"):
                    gc.collect()
                    start = time.perf_counter()
                    quantized, report = load_fp8_transformer_component(
                        work / "transformer",
                        diffusers_family(self.args.family),
                        device=self.device,
                        dtype=self.dtype,
                        cache_dir=work / "fp8-cache",
                    )
                    synchronize(self.device)
                    timings[attempt] = time.perf_counter() - start
                    if attempt == "cold":
                        del quantized
                phase.update(load_cold_s=timings["cold"], load_warm_s=timings["warm"])
                self.log(f"fp8 cache: cold build+load {timings['cold']:.1f} s, warm load {timings['warm']:.1f} s")
                fp8_components = {**components, "transformer": quantized}
            else:  # a copy: the compiled phase still needs the bf16 weights
                quantized = copy.deepcopy(transformer)
                report = quantize_family_fp8(diffusers_family(self.args.family).declaration, quantized)
                fp8_components = {**components, "transformer": quantized}
            phase["quantized_linears"] = len(report.quantized)
            pipe = build(fp8_components, fp8=report)
            pixels = self.timed(
                "fp8", self._omni_call, pipe, quantized, self.args.repeats, self.forwards_per_step(True)
            )
            self.results["phases"]["fp8"].update(
                phase, psnr_vs_bf16_db=psnr(pixels, bf16_pixels), ssim_vs_bf16=ssim(pixels, bf16_pixels)
            )
            if "fp8_compiled" in self.args.phases:
                self.fp8_compiled(pipe, quantized, bf16_pixels)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            quantized = fp8_components = pipe = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def fp8_compiled(self, pipe: Any, quantized: torch.nn.Module, bf16_pixels: np.ndarray) -> None:
        """The FP8 transformer under regional compile, once per activation scaling (set on every FP8Linear)."""
        from fp8_cache import FP8Linear

        backend = "eager" if self.args.smoke else "inductor"
        linears = [m for m in quantized.modules() if isinstance(m, FP8Linear)]
        for scaling in self.args.fp8_compiled_scaling:
            for linear in linears:
                linear.activation_scaling = scaling  # each FP8Linear's own (quantize_model's argument)
            torch._dynamo.reset()
            start = time.perf_counter()
            pipe.compile_transformer(backend=backend)
            name = "fp8_compiled" if scaling == "tensor" else f"fp8_compiled_{scaling}"
            pixels = self.timed(name, self._omni_call, pipe, quantized, self.args.repeats, self.forwards_per_step(True))
            self.results["phases"][name].update(
                first_call_and_runs_s=time.perf_counter() - start,
                activation_scaling=scaling,
                psnr_vs_bf16_db=psnr(pixels, bf16_pixels),
                ssim_vs_bf16=ssim(pixels, bf16_pixels),
            )
        for linear in linears:
            linear.activation_scaling = "tensor"  # back to what the model was quantized with

    def step_cache_configs(self) -> dict[str, Any]:
        steps = self.request["steps"]
        mask = FAST_ON_TRAINED.get((self.args.family, steps), [0, steps - 1] if self.args.smoke else "fast")
        return {  # the target's figure first (off, fast_mask), so that a run cut short has it
            "off": None,
            "fast_mask": {"method": "mask", "mask": mask, "first_blocks": 1, "max_consecutive_cached": None},
            "fast": "fast",
            "safe": "safe",
        }

    def _cached_request(self, pipe: Any, steps: int, cache: Any) -> dict[str, Any]:
        """One request (index 0, same prompt and seed every time): denoising-loop and end-to-end seconds."""
        synchronize(self.device)
        start = time.perf_counter()
        jobs = self._prepare(pipe, 0, steps, cache)
        pipe.start(jobs)
        synchronize(self.device)
        loop_start = time.perf_counter()
        while not all(job.finished for job in jobs):
            pipe.step(jobs)
        synchronize(self.device)
        loop_end = time.perf_counter()
        pipe.decode(jobs)
        synchronize(self.device)
        end = time.perf_counter()
        stats = jobs[0].step_cache.stats() if jobs[0].step_cache is not None else None
        pipe.release(jobs)
        return {
            "denoise_s": loop_end - loop_start,
            "e2e_s": end - start,
            "decisions": stats.decisions if stats else "C" * steps,
            "computed_fraction": stats.computed_fraction if stats else 1.0,
            "block_fraction": stats.block_fraction if stats else 1.0,
        }

    def step_cache(self, pipe: Any, label: str = "step_cache", names: tuple[str, ...] | None = None) -> None:
        steps = self.request["steps"]
        configs = self.step_cache_configs()
        if names is not None:
            configs = {name: configs[name] for name in names}
        self._cached_request(pipe, min(3, steps), None)  # warm-up (and the first compile, when compiled)
        for cache in ("safe", "fast"):
            if cache in configs:
                self._cached_request(pipe, min(3, steps), cache)
        phase: dict[str, Any] = {"steps": steps, "repeats": self.args.step_cache_repeats, "configs": {}}
        for name, cache in configs.items():
            runs = [self._cached_request(pipe, steps, cache) for _ in range(self.args.step_cache_repeats)]
            phase["configs"][name] = {
                "cache": cache,
                "denoise_s": summary([r["denoise_s"] for r in runs]),
                "e2e_s": summary([r["e2e_s"] for r in runs]),
                "decisions": sorted({r["decisions"] for r in runs}),
                "computed_fraction": statistics.mean(r["computed_fraction"] for r in runs),
                "block_fraction": statistics.mean(r["block_fraction"] for r in runs),
            }
            off = phase["configs"]["off"]
            for config in phase["configs"].values():
                config["denoise_speedup_vs_off"] = off["denoise_s"]["median"] / config["denoise_s"]["median"]
                config["e2e_speedup_vs_off"] = off["e2e_s"]["median"] / config["e2e_s"]["median"]
            self.log(
                f"{label} {name}: denoise {phase['configs'][name]['denoise_s']['median']:.3f} s "
                f"({phase['configs'][name]['denoise_speedup_vs_off']:.2f}x off), "
                f"computed {phase['configs'][name]['computed_fraction']:.3f} ({runs[-1]['decisions']})"
            )
            self.results["phases"][label] = phase
            self.args.out.mkdir(parents=True, exist_ok=True)  # kept after each config: a cut run keeps what ran
            (self.args.out / f"real_models_{self.args.family}_partial.json").write_text(
                json.dumps(self.results, indent=1, default=str)
            )

    def compiled(
        self, components: dict[str, Any], reference: Any, build: Callable[..., Any], diffusers_processors: dict
    ) -> None:
        transformer = components["transformer"]
        backend = "eager" if self.args.smoke else "inductor"
        if self.args.baseline == "diffusers":
            transformer.set_attn_processor(diffusers_processors)
            torch._dynamo.reset()
            start = time.perf_counter()
            transformer.compile_repeated_blocks(backend=backend)
            self.timed(
                "diffusers_compiled",
                self._diffusers_call,
                reference,
                transformer,
                self.args.repeats,
                self.forwards_per_step(False),
            )
            self.results["phases"]["diffusers_compiled"]["first_call_and_runs_s"] = time.perf_counter() - start
        torch._dynamo.reset()
        pipe = build(components)  # installs omni's processors again
        start = time.perf_counter()
        pipe.compile_transformer(backend=backend)
        self.timed("omni_compiled", self._omni_call, pipe, transformer, self.args.repeats, self.forwards_per_step(True))
        self.results["phases"]["omni_compiled"]["first_call_and_runs_s"] = time.perf_counter() - start

    def run(self) -> dict[str, Any]:
        from omni_models import synthetic
        from omni_models.diffusers_adapter import build_family_pipeline

        family, phases = self.args.family, set(self.args.phases)
        components = self.build()
        transformer = components["transformer"]

        def build(parts: dict[str, Any], **kwargs: Any) -> Any:
            return build_family_pipeline(
                diffusers_family(family), parts, name=f"random-{family}", device=self.device, dtype=self.dtype, **kwargs
            )

        reference = synthetic.diffusers_pipeline(family, components)
        reference.set_progress_bar_config(disable=True)
        diffusers_processors = dict(transformer.attn_processors)
        steps_eager = self.forwards_per_step(False)
        if self.args.baseline == "diffusers":
            diffusers_pixels = self.timed(
                "diffusers", self._diffusers_call, reference, transformer, self.args.repeats, steps_eager
            )
        pipe = build(components)
        omni_pixels = self.timed(
            "omni", self._omni_call, pipe, transformer, self.args.repeats, self.forwards_per_step(True)
        )
        if self.args.baseline == "diffusers":
            self.results["phases"]["omni"]["psnr_vs_diffusers_db"] = psnr(omni_pixels, diffusers_pixels)
        if "concurrency" in phases:
            self.concurrency(pipe)
        if "engine" in phases:
            self.engine(pipe)
        if "fp8" in phases:  # before compiling: the FP8 transformer (a new module) runs eager
            self.fp8(components, build, omni_pixels)
        if "offload" in phases:  # before compiling: offload's hooks must run outside compiled blocks
            self.offload(components, build, omni_pixels)
        if "step_cache" in phases:
            names = self.args.step_cache_configs
            self.step_cache(pipe, names=None if names is None else tuple(names))
            past = self.args.deadline is not None and time.perf_counter() - self.started > self.args.deadline
            if self.args.step_cache_compiled and not past:
                from omni_models.compilation import CompileSettings, compile_modules

                # The transformer's blocks as serving compiles them (the VAE decoder, outside the loop, is not).
                targets = pipe.backend.compile_targets()
                blocks = targets[: len(targets) - len(pipe.backend.compiled_vae_modules)]
                torch._dynamo.reset()
                start = time.perf_counter()
                compile_modules(blocks, CompileSettings(backend="eager" if self.args.smoke else "inductor"))
                self.step_cache(pipe, "step_cache_compiled", ("off", "fast_mask"))
                self.results["phases"]["step_cache_compiled"]["compile_and_runs_s"] = time.perf_counter() - start
            elif self.args.step_cache_compiled:
                self.results["phases"]["step_cache_compiled"] = {"skipped": f"past --deadline {self.args.deadline} s"}
        if "compiled" in phases:
            self.compiled(components, reference, build, diffusers_processors)
        self.results["total_s"] = time.perf_counter() - self.started
        return self.results


def ratios(results: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(what, ratio, target, met) for every target whose phases ran; speed ratios are >1 when omni is faster."""
    phases = results["phases"]

    def speed(base: str, new: str, key: str = "ms_per_step") -> float:
        return phases[base][key]["median"] / phases[new][key]["median"]

    lines = []
    for label, base, new, target in (
        ("omni bf16 vs diffusers, eager", "diffusers", "omni", "omni_vs_diffusers_eager"),
        ("omni bf16 vs diffusers, compiled", "diffusers_compiled", "omni_compiled", "omni_vs_diffusers_compiled"),
        ("omni FP8 vs omni bf16, eager", "omni", "fp8", "fp8_vs_bf16"),
        ("omni FP8 vs omni bf16, compiled", "omni_compiled", "fp8_compiled", "fp8_vs_bf16"),
        ("omni FP8 (row scales) vs omni bf16, compiled", "omni_compiled", "fp8_compiled_row", "fp8_vs_bf16"),
    ):
        if base in phases and new in phases:
            for key, unit in (("ms_per_step", "transformer ms/step"), ("e2e_s", "end-to-end s")):
                value = speed(base, new, key)
                lines.append((f"{label} ({unit})", value, TARGETS[target], value >= TARGETS[target]))
    if "offload" in phases:
        for key, unit in (("ms_per_step", "transformer ms/step"), ("e2e_s", "end-to-end s")):
            value = 1 / speed("omni", "offload", key)
            target = TARGETS["offload_vs_resident_max"]
            lines.append((f"offload time / resident time ({unit})", value, target, value <= target))
        batched = phases["offload"].get("batched")
        if batched:
            lines.append(
                (
                    f"offload time / resident time, {batched['requests']} requests together",
                    batched["ratio"],
                    TARGETS["offload_vs_resident_max"],
                    batched["ratio"] <= TARGETS["offload_vs_resident_max"],
                )
            )
    for phase, label in (("concurrency", "stepwise API"), ("engine", "omni-server engine")):
        if phase in phases:
            value = phases[phase]["throughput_ratio"]
            lines.append(
                (
                    f"4 concurrent vs one after another, {label} (throughput)",
                    value,
                    TARGETS["concurrency_throughput"],
                    value >= TARGETS["concurrency_throughput"],
                )
            )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("flux", "qwen-image"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, fp32, 32x32, 3 steps (CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed images per phase (default 3 FLUX, 1 Qwen)")
    parser.add_argument("--steps", type=int, default=None, help="override the family's step count")
    parser.add_argument(
        "--concurrency-steps",
        type=int,
        default=None,
        help="steps per request in the concurrency phase (default: all; 10 for Qwen-Image)",
    )
    parser.add_argument("--text-encoder-layers", type=int, default=2)
    parser.add_argument("--offload-resident-blocks", type=int, default=0)
    parser.add_argument("--fp8-source", choices=("cache", "online"), default="cache")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the bf16 transformer and its FP8 cache are written (removed afterwards)",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["concurrency", "engine", "offload", "compiled", "fp8"],
        choices=(
            "concurrency",
            "engine",
            "offload",
            "offload_batched",
            "compiled",
            "fp8",
            "fp8_compiled",
            "step_cache",
        ),
        help="phases after diffusers and omni eager (which always run)",
    )
    parser.add_argument(
        "--baseline",
        choices=("diffusers", "none"),
        default="diffusers",
        help="'none' skips diffusers' pipeline (eager and compiled)",
    )
    parser.add_argument(
        "--fp8-compiled-scaling",
        nargs="+",
        choices=("tensor", "row"),
        default=["tensor", "row"],
        help="activation scalings timed in the fp8_compiled phase",
    )
    parser.add_argument(
        "--offload-batched-steps", type=int, default=8, help="steps per request in the offload_batched phase"
    )
    parser.add_argument("--step-cache-repeats", type=int, default=5, help="timed requests per step-cache config")
    parser.add_argument(
        "--step-cache-configs",
        nargs="+",
        choices=("off", "fast_mask", "fast", "safe"),
        default=None,
        help="step_cache: only these configs (default: all four)",
    )
    parser.add_argument(
        "--step-cache-compiled",
        action="store_true",
        help="step_cache: then compile the blocks as serving does and time off and fast_mask again",
    )
    parser.add_argument("--deadline", type=float, default=None, help="seconds: skip --step-cache-compiled after it")
    args = parser.parse_args(argv)
    require_diffusers()
    if args.repeats is None:
        args.repeats = 1 if args.smoke or args.family == "qwen-image" else 3
    if args.concurrency_steps is None and args.family == "qwen-image" and not args.smoke:
        args.concurrency_steps = 10
    results = Bench(args).run()
    results.update(
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        dtype="float32" if args.smoke else "bfloat16",
        smoke=args.smoke,
        repeats=args.repeats,
        targets=TARGETS,
    )
    import diffusers
    import transformers

    results.update(diffusers=diffusers.__version__, transformers=transformers.__version__)
    results["ratios"] = [{"what": w, "ratio": v, "target": t, "met": m} for w, v, t, m in ratios(results)]
    print(
        f"\n{args.family} on {results['device']} ({results['dtype']}, {results['request']['size']}^2, "
        f"{results['request']['steps']} steps, text encoders: {results['text_encoders']})"
    )
    for phase, values in results["phases"].items():
        if "ms_per_step" in values:
            step, e2e = values["ms_per_step"], values["e2e_s"]
            print(
                f"  {phase:<20} {step['median']:9.1f} ms/step [{step['min']:.1f}, {step['max']:.1f}]  "
                f"{e2e['median']:8.2f} s/image [{e2e['min']:.2f}, {e2e['max']:.2f}]"
            )
    for label in ("step_cache", "step_cache_compiled"):
        for name, config in results["phases"].get(label, {}).get("configs", {}).items():
            d = config["denoise_s"]
            print(
                f"  {label} {name:<10} denoise {d['median']:.3f} s [{d['min']:.3f}, {d['max']:.3f}], "
                f"{config['denoise_speedup_vs_off']:.2f}x vs off (computed {config['computed_fraction']:.3f}, "
                f"blocks {config['block_fraction']:.3f})"
            )
    for what, value, target, met in ratios(results):
        relation = "<=" if "offload" in what else ">="
        print(f"  {what}: {value:.2f}x (target {relation} {target}x) {'MET' if met else 'NOT MET'}")
    if "fp8" in results["phases"]:
        fp8 = results["phases"]["fp8"]
        print(
            f"  FP8 vs bf16 image: PSNR {fp8['psnr_vs_bf16_db']:.1f} dB, SSIM {fp8['ssim_vs_bf16']:.4f} "
            f"(weights: {fp8['source']})"
        )
    if "psnr_vs_diffusers_db" in results["phases"]["omni"]:
        print(
            f"  omni vs diffusers image (bf16 parity): PSNR {results['phases']['omni']['psnr_vs_diffusers_db']:.1f} dB"
        )
    print(f"  total {results['total_s']:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"real_models_{args.family}.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
