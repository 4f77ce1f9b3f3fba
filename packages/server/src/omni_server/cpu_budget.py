"""How many CPUs this process may really use, and torch's intra-op thread count derived from it.

``os.cpu_count()`` counts the machine. A process may be confined to fewer CPUs by its affinity mask
(``taskset``, cpusets) or throttled by a CFS quota (containers: cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``). Running more compute threads than that makes every step wait
for descheduled threads; spinning OpenMP workers burn the CPU the others need. So the engine uses
``min(affinity, floor(quota))`` threads (at least 1) and passive OpenMP waits, unless the operator set
``OMP_NUM_THREADS`` / ``OMP_WAIT_POLICY`` explicitly (they win).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadBudget:
    count: int
    source: str  # what decided the count, for the log


def cgroup_cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> float | None:
    """The CFS quota of this process's cgroup in CPUs (``1.5`` = one and a half), or None when unlimited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            for candidate in (root / path / "cpu.max", root / "cpu.max"):
                quota = _read_v2(candidate)
                if quota is not None:
                    return quota if quota > 0 else None
        elif "cpu" in controllers.split(","):  # cgroup v1
            for base in (root / controllers / path, root / "cpu" / path, root / controllers, root / "cpu"):
                quota = _read_v1(base)
                if quota is not None:
                    return quota if quota > 0 else None
    return None


def _read_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return -1.0 if quota == "max" else int(quota) / int(period)


def _read_v1(base: Path) -> float | None:
    try:
        quota = int((base / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return -1.0 if quota < 0 else quota / period


def usable_cpus(quota: float | None = None, affinity: int | None = None) -> ThreadBudget:
    """``min(affinity, floor(quota))``, at least 1; arguments default to this process's own values."""
    affinity = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cgroup_cpu_quota() if quota is None else quota
    if quota is not None and quota > 0 and math.floor(quota) < affinity:
        return ThreadBudget(max(1, math.floor(quota)), f"cgroup CPU quota {quota:g}")
    return ThreadBudget(max(1, affinity), f"{affinity} CPUs in the affinity mask")


def configure_intra_op_threads(env: MutableMapping[str, str]) -> ThreadBudget:
    """Set the OpenMP environment of this process, then torch's intra-op thread count; returns the budget.

    Must run before anything else imports torch (OpenMP reads its environment once, when it starts); it
    imports torch itself and calls ``torch.set_num_threads``, since torch's own default also looks at other
    variables (``MKL_NUM_THREADS``) and at the machine's cores.
    """
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        budget = ThreadBudget(int(explicit), "OMP_NUM_THREADS set by the operator")
    else:
        budget = usable_cpus()
        env["OMP_NUM_THREADS"] = str(budget.count)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP workers sleep instead of spinning
    import torch

    torch.set_num_threads(budget.count)
    return budget
