"""Real processes on real files: SIGKILL during publication, and four concurrent builders."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp8_cache import build_fp8_cache, check_artifact, load_fp8_weights, verify_artifact

from .conftest import make_component, same_tensors

# The child slows every fsync/rename a little and announces it first, so the parent can kill it *at* a chosen
# publication step (before the operation runs) or a random moment after it. Nothing in the library is patched
# beyond these two os functions; the real builder writes real files.
CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    src, dst, delay, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    real_fsync, real_rename = os.fsync, os.rename
    counter = [0]
    def announce(kind):
        counter[0] += 1
        print(f"step {counter[0]} {kind}", flush=True)
        time.sleep(delay)
    def fsync(fd):
        announce("fsync")
        real_fsync(fd)
    def rename(a, b):
        announce("rename")
        real_rename(a, b)
    os.fsync, os.rename = fsync, rename
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from fp8_cache import build_fp8_cache, load_fp8_weights
    if mode != "plain":  # "elect-writer" or "no-lock": report ready, wait for the go file, then race
        print("ready", flush=True)
        while not os.path.exists(sys.argv[5]):
            time.sleep(0.001)
    elect = mode != "no-lock"
    result = build_fp8_cache(src, dst, ignore=["embed"], max_shard_bytes=4096, elect_writer=elect)
    os.fsync, os.rename = real_fsync, real_rename
    loaded = load_fp8_weights(src, dst, device="cpu", ignore=["embed"], publish=False)
    print("result", json.dumps({"action": result.action, "hit": loaded.hit}), flush=True)
    """
)


def _spawn(script: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _source_cache_and_child(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A source component, where its cache goes, and the builder child script."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return make_component(tmp_path / "source"), tmp_path / "cache", script


def _assert_miss_or_valid(component: Path, cache: Path, online: dict) -> bool:
    """Every load after a crash sees either a miss or a complete, valid, bit-identical artifact."""
    manifest, reason = check_artifact(cache)
    if manifest is None:
        assert "does not exist" in reason or "stale" in reason, reason
        return False
    assert verify_artifact(cache)[1] == "ok"
    loaded = load_fp8_weights(component, cache, device="cpu", ignore=["embed"], publish=False)
    assert loaded.hit and same_tensors(loaded.tensors, online)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("start", ["empty", "stale"])
def test_sigkill_at_random_points_during_publication_leaves_a_miss_or_a_valid_artifact(tmp_path, start):
    component, cache, script = _source_cache_and_child(tmp_path)
    if start == "stale":  # a previous artifact whose source has since changed: replacement must be atomic too
        build_fp8_cache(component, cache, ignore=["embed"])
        make_component(component, seed=7)
        for f in component.glob("*.safetensors"):
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        shutil.copytree(cache, tmp_path / "stale-backup")
    online = load_fp8_weights(component, None, device="cpu", ignore=["embed"]).tensors

    # Count the publication steps of an undisturbed build in a scratch location.
    probe = _spawn(script, str(component), str(tmp_path / "probe"), "0", "plain")
    out, err = probe.communicate(timeout=60)
    assert probe.returncode == 0, err
    steps = sum(line.startswith("step ") for line in out.splitlines())
    assert steps >= 8  # shards, index, manifest, COMPLETE, directories and the final rename

    rng = random.Random(1234 if start == "empty" else 4321)
    kill_points = sorted({steps, steps - 1, rng.randrange(1, steps - 1)})
    outcomes = []
    for step in kill_points:
        child = _spawn(script, str(component), str(cache), "0.02", "plain")
        assert child.stdout is not None
        reached = False
        for line in child.stdout:
            if line.startswith(f"step {step} "):
                reached = True
                time.sleep(rng.uniform(0.0, 0.03))  # sometimes before the operation, sometimes after it
                break
        assert reached, f"the builder finished without reaching publication step {step}"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        outcomes.append(_assert_miss_or_valid(component, cache, online))
        if outcomes[-1]:  # published before the kill: restore the starting state for the next kill point
            shutil.rmtree(cache)
            if start == "stale":
                shutil.copytree(tmp_path / "stale-backup", cache)
    assert not all(outcomes), "no kill landed before publication; the test would not catch a torn artifact"

    # Whatever the kills left behind, the next builder publishes (or finds) a valid artifact and sweeps debris.
    final = build_fp8_cache(component, cache, ignore=["embed"])
    assert final.action in ("published", "already_valid")
    assert _assert_miss_or_valid(component, cache, online)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".cache.") and p.name != ".cache.lock"]
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["elect-writer", "no-lock"])
def test_four_processes_building_at_once_publish_exactly_once_and_all_load_it(tmp_path, mode):
    component, cache, script = _source_cache_and_child(tmp_path)
    go = tmp_path / "go"
    children = [_spawn(script, str(component), str(cache), "0.01", mode, str(go)) for _ in range(4)]
    for child in children:  # every child has imported torch and the library before anyone starts
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for child in children:
        out, err = child.communicate(timeout=90)
        assert child.returncode == 0, err
        assert "WARNING" not in err and "Traceback" not in err, err
        (line,) = [ln for ln in out.splitlines() if ln.startswith("result ")]
        results.append(json.loads(line.removeprefix("result ")))
    actions = sorted(r["action"] for r in results)
    assert actions.count("published") == 1, actions
    assert all(a in ("adopted", "already_valid") for a in actions if a != "published"), actions
    assert all(r["hit"] for r in results)
    online = load_fp8_weights(component, None, device="cpu", ignore=["embed"]).tensors
    assert _assert_miss_or_valid(component, cache, online)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".stale-" in p.name] == []
