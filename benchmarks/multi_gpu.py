"""One request on two GPUs inside omni-server's engine, against single-GPU omni in the same run (issue 15).

Builds the engine exactly as ``omni-server serve`` does (``omni_server.engine.build_engine``: the engine process
is rank 0 and starts one worker process per further GPU) for each configuration below, sends it requests
through ``EngineCore.add``/``step`` and times add -> finished (prefix, every denoise step, decode, PNG):

  1gpu                   one GPU, weights resident (the baseline of every ratio)
  1gpu-offload           one GPU, layerwise offload, rank-local (whole blocks from this rank's host copy)
  cfg2                   --cfg-parallel-size 2: cond row on GPU 0, uncond row on GPU 1
  sp2                    --sequence-parallel-size 2: Ulysses over the 16 heads
  sp2-offload-allgather  SP 2 + --enable-layerwise-offload --offload-allgather: each rank's host holds half of
                         every block, which is AllGathered into the device slot just in time

Workloads (random-weight ~2B causal-prefix DiT, ``large_config`` shapes, bf16): ``cfg`` one guided request at
64x64 (1024 image tokens, 2 CFG rows); ``uncond`` one unguided request at 64x64 (how a CFG-parallel server
serves it); ``long`` one unguided request at 128x128 (4096 image tokens); ``xl`` 192x192 (9216 tokens). Also
measured: NCCL all-to-all and all-gather bandwidth between the two GPUs (for the 8-GPU plan), rank 0's device
memory of weights (allocated minus the KV pool), and every image's PSNR against the 1gpu image of the same seed.

GPU (2 GPUs, NVLink multicast off):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=packages/diffusion-kv/src:packages/dlo-offload/src:packages/fp8-cache/src:\
packages/models/src:packages/server/src python3 benchmarks/multi_gpu.py --out "$OUT"
CPU smoke (gloo, a tiny 4-head model, 2 steps): ``python benchmarks/multi_gpu.py --smoke --out /tmp/mg``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT = "a red circle at the top left"
CONFIGS: dict[str, dict] = {
    "1gpu": {},
    "1gpu-offload": {"enable_layerwise_offload": True},
    "cfg2": {"cfg_parallel_size": 2},
    "sp2": {"sequence_parallel_size": 2},
    "sp2-offload-allgather": {"sequence_parallel_size": 2, "enable_layerwise_offload": True, "offload_allgather": True},
}
# Which workloads each configuration runs (the baseline runs them all).
RUNS: dict[str, tuple[str, ...]] = {
    "1gpu": ("cfg", "uncond", "long", "xl"),
    "1gpu-offload": ("long",),
    "cfg2": ("cfg", "uncond"),
    "sp2": ("cfg", "long", "xl"),
    "sp2-offload-allgather": ("long",),
}


def write_model(directory: Path, smoke: bool) -> dict:
    """A random-weight causal-prefix DiT directory (every weight random, so outputs depend on every path)."""
    from omni_models.checkpoint import load_config, save_model
    from omni_models.config import DiTConfig
    from omni_models.hub import resolve_model_dir
    from omni_models.model import CausalPrefixDiT

    _, vocabulary = load_config(resolve_model_dir("omni-shapes-tiny"))
    if smoke:
        config = DiTConfig(
            name="mg-smoke",
            width=64,
            depth=2,
            num_heads=4,
            patch_size=4,
            vocab_size=len(vocabulary),
            max_prompt_tokens=16,
            supported_sizes=((32, 32), (48, 48), (64, 64)),
            default_steps=2,
        )
        sizes = {"cfg": (32, 32), "uncond": (32, 32), "long": (48, 48), "xl": (64, 64)}
    else:  # large_config's shapes (width 2048, 28 blocks, 16 heads, patch 2), our vocabulary
        config = DiTConfig(
            name="causal-prefix-dit-2b",
            width=2048,
            depth=28,
            num_heads=16,
            patch_size=2,
            vocab_size=len(vocabulary),
            max_prompt_tokens=64,
            supported_sizes=((64, 64), (128, 128), (192, 192)),
            default_steps=20,
        )
        sizes = {"cfg": (64, 64), "uncond": (64, 64), "long": (128, 128), "xl": (192, 192)}
    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
        with torch.device(device):
            model = CausalPrefixDiT(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    parameter.fill_(1.0)
                elif parameter.dim() >= 2:
                    parameter.normal_(0.0, 1.0 / math.sqrt(parameter.shape[1]))
                else:
                    parameter.normal_(0.0, 0.02)
        model.to(torch.float32 if smoke else torch.bfloat16)
        save_model(model, vocabulary, directory, max_shard_bytes=2**31)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {
        "config": config.to_dict(),
        "sizes": sizes,
        "parameters": sum(p.numel() for p in _meta_model(config).parameters()),
    }


def _meta_model(config):
    from omni_models.model import CausalPrefixDiT

    with torch.device("meta"):
        return CausalPrefixDiT(config)


# -- collective bandwidth ------------------------------------------------------------------------------------------


def _bandwidth_rank(rank: int, world: int, port: int, smoke: bool, out: str) -> None:
    import torch.distributed as dist

    backend = "gloo" if smoke else "nccl"
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    sizes = [2**20, 2**22] if smoke else [2**20, 2**23, 2**25, 2**27, 2**29]
    results = []
    for nbytes in sizes:
        elements = nbytes // 2
        x = torch.ones(elements, dtype=torch.bfloat16, device=device)
        a2a_out = torch.empty_like(x)
        ag_out = torch.empty(elements * world, dtype=torch.bfloat16, device=device)
        ops = {
            "all_to_all": lambda out=a2a_out, x=x: dist.all_to_all_single(out, x),
            "all_gather": lambda out=ag_out, x=x: all_gather(out, x),
        }
        for name, op in ops.items():
            for _ in range(3):
                op()
            if not smoke:
                torch.cuda.synchronize()
            iters = 3 if smoke else 20
            start = time.perf_counter()
            for _ in range(iters):
                op()
            if not smoke:
                torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / iters
            # nccl-tests conventions: all-gather's size is the output; bus bandwidth = alg * (n - 1) / n.
            size = nbytes * world if name == "all_gather" else nbytes
            alg = size / seconds / 1e9
            results.append(
                {
                    "op": name,
                    "bytes": size,
                    "seconds": seconds,
                    "algbw_GBps": alg,
                    "busbw_GBps": alg * (world - 1) / world,
                }
            )
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def measure_bandwidth(smoke: bool, out: Path) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = out / "bandwidth.json"
    mp.spawn(_bandwidth_rank, args=(2, port, smoke, str(path)), nprocs=2, join=True)
    return json.loads(path.read_text())


# -- engine runs ---------------------------------------------------------------------------------------------------


def _run_request(engine, request_id: str, request) -> tuple[float, bytes]:
    from omni_server.protocol import RequestFinished

    start = time.perf_counter()
    engine.add(request_id, request)
    while True:
        for output in engine.step():
            if isinstance(output, RequestFinished) and output.request_id == request_id:
                if output.error is not None:
                    raise RuntimeError(f"{request_id}: {output.error.message}")
                return time.perf_counter() - start, output.outputs[0]


def _throughput(engine, request, count: int) -> float:
    """Images per second with ``count`` requests admitted together (their rows share every forward)."""
    from omni_server.protocol import RequestFinished

    start = time.perf_counter()
    pending = {f"tp-{i}" for i in range(count)}
    for request_id in sorted(pending):
        engine.add(request_id, request)
    while pending:
        for output in engine.step():
            if isinstance(output, RequestFinished):
                if output.error is not None:
                    raise RuntimeError(f"{output.request_id}: {output.error.message}")
                pending.discard(output.request_id)
    return count / (time.perf_counter() - start)


THROUGHPUT = {"1gpu", "1gpu-offload", "sp2", "sp2-offload-allgather"}  # 'long' with 2 requests at once


def run_config(name: str, model_dir: Path, sizes: dict, steps: int, repeats: int, smoke: bool) -> dict:
    from omni_models import GenerationRequest, resolve_request
    from omni_models.checkpoint import load_config
    from omni_server.config import ServerConfig
    from omni_server.engine import build_engine

    config = ServerConfig(
        model=str(model_dir),
        device="cpu" if smoke else "cuda",
        kv_cache_memory_bytes=(64 if smoke else 12 * 1024) * 2**20,
        max_num_seqs=2,
        log_level="warning",
        **CONFIGS[name],
    )
    if not smoke:
        torch.cuda.reset_peak_memory_stats(0)
    started = time.perf_counter()
    engine = build_engine(config)
    patch = load_config(model_dir)[0].patch_size
    result: dict = {"start_s": time.perf_counter() - started, "world_size": config.world_size, "workloads": {}}
    if not smoke:
        kv_bytes = sum(cache.numel() * cache.element_size() for cache in engine.pipeline.kv_caches)
        result["rank0_device_bytes_excluding_kv"] = torch.cuda.memory_allocated(0) - kv_bytes
        result["rank0_kv_pool_bytes"] = kv_bytes
    try:
        for workload in RUNS[name]:
            height, width = sizes[workload]
            request = resolve_request(
                engine.info,
                GenerationRequest(
                    prompt=PROMPT,
                    num_inference_steps=steps,
                    seed=1234,
                    height=height,
                    width=width,
                    guidance_scale=4.0 if workload == "cfg" else 1.0,
                ),
            )
            _run_request(engine, f"{workload}-warm", request)  # kernels compiled and autotuned on every rank
            times, png = [], b""
            for i in range(repeats):
                seconds, png = _run_request(engine, f"{workload}-{i}", request)
                times.append(seconds)
            result["workloads"][workload] = {
                "seconds": statistics.median(times),
                "all_seconds": times,
                "image_tokens": (height // patch) * (width // patch),
                "png": png.hex(),
            }
            print(f"{name:>22} {workload:>6}: {statistics.median(times) * 1e3:9.1f} ms", flush=True)
            if workload == "long" and name in THROUGHPUT:
                rate = _throughput(engine, request, 2)
                result["workloads"][workload]["images_per_s_2_concurrent"] = rate
                print(f"{name:>22} {workload:>6}: {rate:.3f} images/s with 2 requests at once", flush=True)
    finally:
        engine.close()
        del engine
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    return result


def _pixels(png_hex: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(bytes.fromhex(png_hex)))).astype(np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--smoke", "--cpu-smoke", dest="smoke", action="store_true", help="CPU over gloo, a tiny 4-head model, 2 steps"
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 20; smoke 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed requests per workload (default 3; smoke 1)")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the random model is written (reused)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    args = parser.parse_args()
    smoke = args.smoke
    if not smoke and torch.cuda.device_count() < 2:
        parser.error(f"needs 2 GPUs, found {torch.cuda.device_count()}; use --smoke on a CPU")
    if not smoke and torch.cuda.device_count() > 2:
        parser.error("make CUDA_VISIBLE_DEVICES list exactly 2 GPUs (one rank per GPU)")
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown or "1gpu" not in names:
        parser.error(f"--configs: unknown {unknown}; '1gpu' (the baseline) must be included")
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (2 if smoke else 20)
    repeats = args.repeats or (1 if smoke else 3)
    model_dir = args.model_dir or args.out / "model"
    started = time.perf_counter()
    model = write_model(model_dir, smoke)
    report: dict = {
        "smoke": smoke,
        "steps": steps,
        "repeats": repeats,
        "model": model,
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not smoke else ["cpu"],
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "model_write_s": time.perf_counter() - started,
    }
    print(f"model ready in {report['model_write_s']:.1f} s ({model['parameters'] / 1e9:.2f} B parameters)", flush=True)
    report["bandwidth"] = measure_bandwidth(smoke, args.out)
    for row in report["bandwidth"]:
        print(f"{row['op']:>10} {row['bytes'] / 2**20:8.1f} MiB: {row['busbw_GBps']:7.1f} GB/s bus", flush=True)
    runs: dict = {}
    report["summary"], report["runs"] = {}, runs
    base_pngs: dict[str, str] = {}
    for name in names:  # the JSON is rewritten after every configuration, so a cut-short run keeps its figures
        run = run_config(name, model_dir, model["sizes"], steps, repeats, smoke)
        runs[name] = run
        for workload, figures in run["workloads"].items():
            png = figures.pop("png")
            base_pngs.setdefault(workload, png)  # the 1gpu image (1gpu runs first and every workload)
            base_seconds = runs["1gpu"]["workloads"][workload]["seconds"]
            entry = {
                "seconds": figures["seconds"],
                "image_tokens": figures["image_tokens"],
                "images_per_s_2_concurrent": figures.get("images_per_s_2_concurrent"),
                "speedup_vs_1gpu": base_seconds / figures["seconds"],
                "psnr_vs_1gpu_db": psnr(_pixels(base_pngs[workload]), _pixels(png)),
            }
            report["summary"][f"{name}/{workload}"] = entry
            print(
                f"{name + '/' + workload:>30}: {entry['seconds'] * 1e3:9.1f} ms  {entry['speedup_vs_1gpu']:5.2f}x  "
                f"PSNR {entry['psnr_vs_1gpu_db']:.1f} dB",
                flush=True,
            )
        if "rank0_device_bytes_excluding_kv" in run:
            print(
                f"{name:>22}: rank 0 device memory without KV {run['rank0_device_bytes_excluding_kv'] / 2**30:.2f} GiB",
                flush=True,
            )
        (args.out / "multi_gpu.json").write_text(json.dumps(report, indent=1))
    print(f"total {time.perf_counter() - started:.1f} s; wrote {args.out / 'multi_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
