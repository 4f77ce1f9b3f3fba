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
