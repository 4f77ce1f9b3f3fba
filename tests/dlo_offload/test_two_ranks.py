"""Two real processes over a real gloo group: AllGather reconstruction and DP waves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("two_rank_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_ranks")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("two-rank worker hung")
    missing = [r for r in range(2) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no report:\n" + "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_allgather_reconstructs_every_tensor_byte_exact_including_fp8(reports: list[dict]) -> None:
    for report in reports:
        assert report["mode"] == "allgather"
        assert report["fp8_checked"] == "torch.float8_e4m3fn"
        assert report["mismatched_tensors"] == []
        assert report["outputs_equal"] == [True, True, True]
        assert report["restored_equal"]
        assert 0.45 <= report["host_fraction"] <= 0.6  # each rank keeps about half of every block


def test_no_allgather_mode_streams_whole_local_blocks_with_resident_layers(reports: list[dict]) -> None:
    for report in reports:
        assert report["rank_local"] == ["rank_local", 1, True]


def test_allgather_refuses_resident_blocks_and_layout_disagreement(reports: list[dict]) -> None:
    for report in reports:
        assert "Pass use_allgather=False or resident_blocks=0" in report["resident_with_allgather"]
        assert "DLO ranks disagree on the streamed block layout" in report["layout_disagreement"]
        assert report["layout_disagreement_left_model"]


def test_dp_wave_forms_or_is_refused_alike_on_every_rank(reports: list[dict]) -> None:
    for report in reports:
        assert report["wave_ids"] == ["req-0", "req-1"]
        assert "same explicit num_inference_steps (None is not allowed), got [4, 6]" in report["refused_steps"]
        assert "empty prompt request IDs: ['req-1']" in report["refused_empty_prompt"]
        assert "share identical extra_args" in report["refused_extra_args"]
        assert report["after_refusals"] == ["ok-0", "ok-1"]


def test_timed_out_wave_fails_closed(reports: list[dict]) -> None:
    report = reports[0]
    assert "DLO DP collective wave timed out after 1.5s" in report["timeout_error"]
    assert 1.4 <= report["timeout_elapsed_s"] < 5.0
    assert report["failure_callbacks"] == ["RuntimeError"]
    assert "failed closed earlier" in report["after_failure"] and report["after_failure_elapsed_s"] < 0.1


def test_wave_whose_peer_dies_fails_within_its_timeout(reports: list[dict]) -> None:
    report = reports[0]
    assert "DLO DP collective wave failed after" in report["peer_death_error"]
    assert "(a peer left or the group broke); the worker group is closed" in report["peer_death_error"]
    assert report["peer_death_elapsed_s"] < 30.0
