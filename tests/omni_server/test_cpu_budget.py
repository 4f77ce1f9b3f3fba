"""The engine's thread budget: affinity mask and cgroup CPU quota (v1 and v2), applied before torch starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from omni_server.cpu_budget import cgroup_cpu_quota, usable_cpus


def test_cgroup_v2_quota(tmp_path) -> None:
    (tmp_path / "proc_cgroup").write_text("0::/box\n")
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "proc_cgroup", tmp_path) == 1.5
    (tmp_path / "box" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "proc_cgroup", tmp_path) is None


def test_cgroup_v1_quota(tmp_path) -> None:
    (tmp_path / "proc_cgroup").write_text("4:memory:/x\n3:cpu,cpuacct:/box\n")
    base = tmp_path / "cpu,cpuacct" / "box"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text("200000\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path / "proc_cgroup", tmp_path) == 2.0
    (base / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path / "proc_cgroup", tmp_path) is None


def test_budget_is_the_smaller_of_affinity_and_quota() -> None:
    assert usable_cpus(quota=1.5, affinity=8).count == 1
    assert usable_cpus(quota=16.0, affinity=4).count == 4
    assert usable_cpus(quota=0.5, affinity=4).count == 1
    assert "quota" in usable_cpus(quota=2.0, affinity=8).source


def _threads_in_child(env: dict[str, str], affinity: set[int] | None = None) -> dict:
    code = (
        "import os, json\n"
        + (f"os.sched_setaffinity(0, {sorted(affinity)!r})\n" if affinity else "")
        + "from omni_server.cpu_budget import configure_intra_op_threads\n"
        "budget = configure_intra_op_threads(os.environ)\n"
        "import torch\n"
        "print(json.dumps({'budget': budget.count, 'torch': torch.get_num_threads(),"
        " 'wait': os.environ.get('OMP_WAIT_POLICY')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_sizes_torch_threads_from_its_affinity_and_does_not_spin() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    cpus = sorted(os.sched_getaffinity(0))
    seen = _threads_in_child(env, {cpus[0]})
    assert seen == {"budget": 1, "torch": 1, "wait": "PASSIVE"}
    seen = _threads_in_child(env)
    assert seen["budget"] == seen["torch"] == usable_cpus().count
    # An operator's explicit setting wins.
    assert _threads_in_child({**env, "OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}) == {
        "budget": 3,
        "torch": 3,
        "wait": "ACTIVE",
    }
