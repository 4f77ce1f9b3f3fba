"""CFG-parallel, Ulysses SP and DLO AllGather: two real processes over gloo reproduce the one-process latents.

Each mode runs the same batch (a guided and an unguided job of two sizes, or a lone unguided job) through the
stepwise paged API in two ranks and compares every rank's final latents with one process's: PSNR >= 40 dB in
float32, and the max abs difference is reported (the attention of each row and head sees the same inputs; only
the per-token GEMMs run on differently shaped batches).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_cases import CACHE, CASES, run_jobs, write_random_model  # noqa: E402

WORKER = Path(__file__).with_name("parallel_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def psnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """PSNR in dB over the reference's range (latents are about [-1, 1] images: peak-to-peak)."""
    mse = float(((reference - other) ** 2).mean())
    peak = float(reference.max() - reference.min())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("random-dit") / "model")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[torch.Tensor]]:
    from omni_models import load

    pipeline = load(str(model_dir), device="cpu", dtype=torch.float32)
    return {name: run_jobs(pipeline, cases) for name, cases in CASES.items()}


def run_ranks(mode: str, model_dir: Path, out: Path, world: int = 2) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), mode, str(model_dir), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{mode}: a rank hung")
    errors = [(out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists()]
    assert not errors and all(p.returncode == 0 for p in procs), "\n".join(errors + [log[-3000:] for log in logs])
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize(
    "mode, cases", [("cfg2", "mixed"), ("cfg2-unguided", "unguided"), ("sp2", "mixed"), ("sp2-allgather", "mixed")]
)
def test_two_ranks_reproduce_the_single_process_latents(mode, cases, model_dir, reference, tmp_path) -> None:
    reports = run_ranks(mode, model_dir, tmp_path)
    for rank, report in enumerate(reports):
        for job, (expected, got) in enumerate(zip(reference[cases], report["latents"], strict=True)):
            value = psnr(expected, got)
            diff = float((expected - got).abs().max())
            print(f"{mode} rank {rank} job {job}: PSNR {value:.1f} dB, max abs diff {diff:.2e}")
            assert value >= 40.0, f"{mode} rank {rank} job {job}: PSNR {value:.1f} dB"
            if mode == "cfg2-unguided":  # the lone row runs on CFG rank 0 exactly as in one process
                assert torch.equal(expected, got)
    # Every rank holds the same latents (any rank can decode).
    for job in range(len(reference[cases])):
        assert torch.equal(reports[0]["latents"][job], reports[1]["latents"][job])
    if mode.startswith("sp2"):
        assert [r["kv_heads"] for r in reports] == [2, 2]  # each rank caches its half of the 4 heads
    if mode == "sp2-allgather":
        assert [r["offload_mode"] for r in reports] == ["allgather", "allgather"]


def test_cfg_ranks_agree_on_every_step_cache_decision(model_dir, tmp_path) -> None:
    """The guided job's cond row runs on CFG rank 0 and its uncond row on rank 1: both ranks sum their rows'
    changes and take one decision per job, the one process takes too; the latents match it."""
    from omni_models import load

    decisions: list = []
    pipeline = load(str(model_dir), device="cpu", dtype=torch.float32)
    expected = run_jobs(pipeline, CASES["mixed"], CACHE, decisions)
    assert all("S" in d for d in decisions)
    reports = run_ranks("cfg2-cache", model_dir, tmp_path)
    for report in reports:
        assert report["decisions"] == decisions
        for want, got in zip(expected, report["latents"], strict=True):
            assert psnr(want, got) >= 40.0
    assert all(torch.equal(a, b) for a, b in zip(reports[0]["latents"], reports[1]["latents"], strict=True))


def test_heads_not_divisible_by_sp_is_refused_with_the_flag_name() -> None:
    from omni_models.parallel import check_sequence_parallel

    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 does not divide the model's 5 attention heads"):
        check_sequence_parallel(5, 2)
    check_sequence_parallel(4, 2)


def test_init_parallel_builds_the_cfg_sp_mesh_over_exactly_world(tmp_path) -> None:
    import torch.distributed as dist

    from omni_models.parallel import init_parallel

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        state = init_parallel()
        assert (state.cfg_size, state.cfg_rank, state.sp_size, state.sp_rank) == (1, 0, 1, 0)
        assert state.cfg_group is state.sp_group is state.offload_group is None  # one rank: no collectives
        with pytest.raises(
            ValueError,
            match=r"WORLD has 1 ranks but cfg_parallel_size x sequence_parallel_size is "
            r"2 x 1 = 2; start that many ranks",
        ):
            init_parallel(cfg_parallel_size=2)
    finally:
        dist.destroy_process_group()
