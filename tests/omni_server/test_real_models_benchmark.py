"""``benchmarks/real_models.py --phases engine`` on the CPU with a tiny synthetic checkpoint: the GPU benchmark's
server-engine mode (4 concurrent requests through ``FamilyEngine`` vs one after another) runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_models.py"


def test_the_engine_phase_reports_throughput_and_latency_percentiles(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--family",
            "flux",
            "--smoke",
            "--device",
            "cpu",
            "--phases",
            "engine",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    phase = json.loads((tmp_path / "real_models_flux.json").read_text())["phases"]["engine"]
    assert phase["requests"] == 4 and phase["throughput_ratio"] > 0
    for mode in ("sequential", "concurrent"):
        latency = phase[f"{mode}_latency_s"]
        assert 0 < latency["p50"] <= latency["p99"] <= phase[f"{mode}_total_s"] + 1e-9
    assert "omni-server engine (throughput)" in result.stdout


def test_the_serving_benchmark_times_edits_over_http_with_and_without_a_step_cache(tmp_path) -> None:
    """``benchmarks/serving.py --family flux-kontext --request-cache`` on the CPU (the tiny checkpoint, a real
    server process, multipart edits): what the H200 call runs, checked here before device time goes into it."""
    script = SCRIPT.with_name("serving.py")
    cache = '{"method": "mask", "mask": [0], "first_blocks": 1}'
    command = [sys.executable, str(script), "--smoke", "--family", "flux-kontext", "--sizes", "32", "--repeats", "1"]
    command += ["--concurrent", "0", "--configs", "default", "--no-warm-start", "--no-diffusers-compile"]
    command += ["--request-cache", cache, "--work-dir", str(tmp_path), "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    entry = report["phases"]["omni_default"]["sizes"]["32"]
    assert entry["psnr_vs_diffusers_db"] >= 40.0  # the served edit is diffusers' FluxKontextPipeline's image
    (usage,) = entry["step_cache"]["usage_step_cache"]
    assert usage["method"] == "mask" and usage["num_steps"] == 2
    assert report["phases"]["omni_default"]["metrics_after"]["omni:recompiles_since_ready"] == 0


def test_the_serving_benchmark_times_videos_over_http_against_diffusers_wan(tmp_path) -> None:
    """``benchmarks/serving.py --family wan`` on the CPU (a tiny random Wan2.1, a real server process writing MP4s
    through PyAV): each request is a ``POST /v1/videos`` polled to its end and downloaded, and the decoded MP4 is
    diffusers' ``WanPipeline`` video (in yuv420p, at ``--video-crf 10`` as ``test_videos_api`` compares)."""
    pytest.importorskip("av")
    script = SCRIPT.with_name("serving.py")
    command = [sys.executable, str(script), "--smoke", "--family", "wan", "--repeats", "1", "--concurrent", "0"]
    command += ["--configs", "default", "--no-warm-start", "--no-diffusers-compile", "--server-args", "--video-crf 10"]
    command += ["--request-cache", '"fast"', "--work-dir", str(tmp_path), "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert report["phases"]["diffusers"]["eager"]["48"]["n"] == 1
    entry = report["phases"]["omni_default"]["sizes"]["48"]
    assert entry["psnr_vs_diffusers_db"] >= 40.0, entry
    assert entry["step_cache"]["serial"]["n"] == 1
    assert "omni_default 48x32x5 PSNR vs diffusers" in result.stdout
