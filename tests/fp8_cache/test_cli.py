"""``fp8-cache build|inspect|verify``: output and exit codes (in-process, plus one real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fp8_cache.cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE, main

from .conftest import make_component


def test_build_inspect_verify_round_trip_and_failures(tmp_path: Path, capsys):
    src = make_component(tmp_path / "src")
    dst = tmp_path / "cache"

    assert main(["inspect", str(dst)]) == EXIT_INVALID
    assert "does not exist" in capsys.readouterr().err

    assert main(["build", str(src), str(dst), "--ignore", "embed"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("published:") and "6 FP8" in out

    assert main(["build", str(src), str(dst), "--ignore", "embed"]) == EXIT_OK
    assert capsys.readouterr().out.startswith("already_valid:")

    assert main(["inspect", str(dst)]) == EXIT_OK
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized_tensor_count"] == 6 and summary["component"] == "transformer"

    assert main(["verify", str(dst)]) == EXIT_OK
    assert capsys.readouterr().out.startswith("ok:")

    shard = sorted((dst / "transformer").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x55
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(dst)]) == EXIT_OK  # cheap checks do not hash
    capsys.readouterr()
    assert main(["verify", str(dst)]) == EXIT_INVALID
    assert "SHA-256" in capsys.readouterr().err

    assert main(["build", str(tmp_path / "missing"), str(tmp_path / "other")]) == EXIT_INVALID
    assert "does not exist" in capsys.readouterr().err
    assert main(["frobnicate"]) == EXIT_USAGE


def test_exit_code_reaches_the_shell(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "fp8_cache.cli", "verify", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_INVALID and "invalid FP8 cache" in done.stderr
