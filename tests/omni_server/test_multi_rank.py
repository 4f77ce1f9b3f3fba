"""``omni-server`` on several ranks (CPU, gloo, real processes on loopback): CFG-parallel, Ulysses SP and DLO
AllGather serve the single-process image; bad combinations fail at start-up naming the flag; a killed worker
turns /health to 503 within 1 s and answers in-flight requests 503 within 5 s; SIGTERM stops every rank cleanly.
"""

from __future__ import annotations

import base64
import io
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "omni_models"))
from parallel_cases import write_random_model  # noqa: E402

REQUEST = {"prompt": "a red circle", "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 7}
POOL = ("--kv-cache-memory-bytes", "8M", "--max-num-seqs", "2")


def _descendants(pid: int, tools) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in tools.child_pids(p)]
        found += children
        frontier = children
    return found


def _workers(server, tools) -> list[int]:
    return [
        pid
        for pid in _descendants(server.process.pid, tools)
        if tools.pid_alive(pid) and b"omni_server.workers" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _image(body: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))).astype(np.float64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("random-dit") / "model")


@pytest.fixture(scope="module")
def reference_images(model_dir: Path) -> dict[float, np.ndarray]:
    """The one-process images (guided and unguided) of REQUEST, from the pipeline itself."""
    import torch

    from omni_models import load

    pipeline = load(str(model_dir), device="cpu", dtype=torch.float32)
    return {
        g: np.asarray(pipeline(REQUEST["prompt"], num_inference_steps=3, guidance_scale=g, seed=7)[0]).astype(
            np.float64
        )
        for g in (4.0, 1.0)
    }


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize(
    "flags",
    [
        ("--cfg-parallel-size", "2"),
        ("--sequence-parallel-size", "2", "--enable-layerwise-offload", "--offload-allgather"),
    ],
    ids=["cfg2", "sp2-allgather"],
)
def test_two_rank_server_serves_the_single_process_image(
    flags, model_dir, reference_images, server_factory, tools
) -> None:
    server = server_factory(str(model_dir), *POOL, *flags)
    assert len(_workers(server, tools)) == 1  # rank 0 is the engine process, rank 1 a worker
    with server.client() as client:
        for guidance in (4.0, 1.0):  # a guided request and one without guidance on the same ranks
            response = client.post("/v1/images/generations", json={**REQUEST, "guidance_scale": guidance})
            assert response.status_code == 200, response.text
            image = _image(response.json())
            value = _psnr(reference_images[guidance], image)
            print(
                f"{flags} guidance {guidance}: PSNR {value:.1f} dB, max diff "
                f"{np.abs(reference_images[guidance] - image).max()}"
            )
            assert value >= 40.0
    server.stop()


def _serve_exit(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_server", "serve", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_combinations_fail_at_start_up_naming_the_flag(model_dir) -> None:
    cases = [
        (
            [str(model_dir), "--device", "cpu", "--sequence-parallel-size", "3"],
            "--sequence-parallel-size: sequence_parallel_size=3",
        ),
        (["--device", "cpu", "--sequence-parallel-size", "2"], "does not divide the model's 5 attention heads"),
        ([str(model_dir), "--device", "cuda", "--cfg-parallel-size", "2"], "--device cuda: no CUDA device is visible"),
        (
            [str(model_dir), "--device", "cpu", "--offload-allgather", "--sequence-parallel-size", "2"],
            "--enable-layerwise-offload",
        ),
        (
            [str(model_dir), "--device", "cpu", "--enable-layerwise-offload", "--offload-allgather"],
            "--sequence-parallel-size >= 2",
        ),
    ]
    for args, expected in cases:
        result = _serve_exit(args)
        assert result.returncode == 2, (args, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, result.stderr[-2000:])
    result = _serve_exit([str(model_dir), "--cfg-parallel-size", "3"])
    assert result.returncode == 2 and "--cfg-parallel-size" in result.stderr


def test_a_killed_worker_fails_fast_and_leaves_no_process(model_dir, server_factory, tools) -> None:
    server = server_factory(str(model_dir), *POOL, "--cfg-parallel-size", "2")
    engine = server.engine_pid()
    workers = _workers(server, tools)
    assert len(workers) == 1

    def long_request(i: int) -> tuple[int, dict, float]:
        response = httpx.post(
            f"{server.url}/v1/images/generations",
            json={"prompt": ("a red circle", "a blue square")[i], "num_inference_steps": 1000, "guidance_scale": 4.0},
            timeout=60,
        )
        return response.status_code, response.json(), time.monotonic()

    with ThreadPoolExecutor(max_workers=2) as pool:
        in_flight = [pool.submit(long_request, i) for i in range(2)]
        server.wait_for_running(2)
        status, killed, _ = server.kill_and_watch_health(workers[0])
        assert status == 503, "/health still 200 one second after a worker was killed"
        for future in in_flight:
            code, body, answered = future.result(timeout=10)
            assert code == 503 and body["error"]["code"] == "engine_dead"
            assert answered - killed < 5.0
    deadline = time.monotonic() + 5
    while tools.pid_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tools.pid_alive(engine), "the engine (rank 0) outlived its dead worker"
    # Whichever saw it first names it: the worker's watcher, or rank 0's collective that broke with the peer gone.
    log = server.log()
    assert "worker group failed" in log
    assert "worker rank 1" in log and "exited with code -9" in log or "rank 0 failed inside a multi-rank" in log
    server.stop()


def test_sigterm_stops_every_rank_cleanly(model_dir, server_factory, tools) -> None:
    server = server_factory(str(model_dir), *POOL, "--sequence-parallel-size", "2")
    ranks = [server.engine_pid(), *_workers(server, tools)]
    assert len(ranks) == 2
    with server.client() as client:
        assert client.post("/v1/images/generations", json=REQUEST).status_code == 200
    server.process.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal it handled after a clean shutdown (-15); the ranks' exits are checked below.
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log()
    deadline = time.monotonic() + 10
    while any(tools.pid_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in ranks if tools.pid_alive(pid)]
    assert "worker group stopped: worker exit codes [0]" in server.log()


def test_multi_gpu_benchmark_runs_its_logic_on_cpu(tmp_path) -> None:
    """benchmarks/multi_gpu.py --smoke: every configuration through the engine over gloo, images equal."""
    import json

    script = Path(__file__).parents[2] / "benchmarks" / "multi_gpu.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert set(report["summary"]) == {
        "1gpu/cfg",
        "1gpu/uncond",
        "1gpu/long",
        "1gpu/xl",
        "1gpu-offload/long",
        "cfg2/cfg",
        "cfg2/uncond",
        "sp2/cfg",
        "sp2/long",
        "sp2/xl",
        "sp2-offload-allgather/long",
    }
    assert all(entry["psnr_vs_1gpu_db"] >= 40.0 for entry in report["summary"].values())
    assert {row["op"] for row in report["bandwidth"]} == {"all_to_all", "all_gather"}
    assert report["runs"]["cfg2"]["world_size"] == 2


def _generate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_server", "generate", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.parametrize(
    "family, flags, extra, front",
    [
        ("flux", ["--sequence-parallel-size", "2"], [], "generate"),
        ("qwen-image", ["--cfg-parallel-size", "2"], ["--negative-prompt", "bad"], "serve"),
    ],
    ids=["flux-sp2-generate", "qwen-cfg2-serve"],
)
def test_a_diffusers_family_on_two_ranks_draws_the_one_process_image(
    family, flags, extra, front, tmp_path, server_factory, tools
) -> None:
    """`omni-server generate` (FLUX.1, two sequence-parallel ranks) and `serve` (Qwen-Image, two CFG ranks) draw
    the image the family's pipeline draws in one process, from a tiny random checkpoint. Both fronts drive the one
    engine and worker group, so each family goes through one of them."""
    pytest.importorskip("diffusers")
    import torch

    from omni_models import load, synthetic

    build = synthetic.flux_components if family == "flux" else synthetic.qwen_image_components
    checkpoint = synthetic.save_checkpoint(family, build("tiny"), tmp_path / family)
    negative = {"negative_prompt": extra[1]} if extra else {}
    one = load(str(checkpoint), device="cpu", dtype=torch.float32)(
        "a red circle", num_inference_steps=2, seed=3, height=32, width=32, **negative
    )[0]
    expected = np.asarray(one).astype(np.float64)
    if front == "generate":
        ranks = _generate(
            [
                "a red circle",
                "--model",
                str(checkpoint),
                "--device",
                "cpu",
                "--steps",
                "2",
                "--image-seed",
                "3",
                "--size",
                "32x32",
                *extra,
                *flags,
                "-o",
                str(tmp_path / "two.png"),
            ],
            tmp_path,
        )
        assert ranks.returncode == 0, ranks.stderr[-3000:]
        drawn = np.asarray(Image.open(tmp_path / "two.png")).astype(np.float64)
    else:
        server = server_factory(str(checkpoint), *flags)
        assert len(_workers(server, tools)) == 1
        body = {"prompt": "a red circle", "num_inference_steps": 2, "seed": 3, "size": "32x32", **negative}
        response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        drawn = _image(response.json())
        server.stop()
    print(f"{family} {flags} via {front}: PSNR {_psnr(expected, drawn):.1f} dB")
    assert _psnr(expected, drawn) >= 40.0


def test_wan_on_two_sequence_parallel_ranks_writes_the_one_process_video(tmp_path) -> None:
    """`omni-server generate` of a tiny random Wan2.1 on two Ulysses ranks (a band of patch rows each) writes the
    frames the one-process pipeline draws (compared in yuv420p, what the MP4 holds)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    import torch

    from omni_models import load, synthetic
    from omni_server import video_io

    checkpoint = synthetic.save_checkpoint("wan", synthetic.wan_components("wan2.1"), tmp_path / "wan")
    shape = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=4)
    one = load(str(checkpoint), device="cpu", dtype=torch.float32)("a red fox", **shape)[0]
    out = tmp_path / "two.mp4"
    ranks = _generate(
        ["a red fox", "--model", str(checkpoint), "--device", "cpu", "--size", "48x32", "--num-frames", "5"]
        + ["--steps", "2", "--image-seed", "4", "--video-crf", "10", "--sequence-parallel-size", "2", "-o", str(out)],
        tmp_path,
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "worker group ready: 2 ranks (cfg 1 x sp 2" in ranks.stderr
    drawn = video_io.decode_mp4(out.read_bytes(), pixel_format="yuv420p").frames.astype(np.float64)
    expected = video_io.yuv420p(one.frames).astype(np.float64)
    assert drawn.shape == expected.shape
    mse = float(((drawn - expected) ** 2).mean())
    assert mse == 0 or 10 * np.log10(255.0**2 / mse) >= 40.0
