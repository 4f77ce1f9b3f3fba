"""Bad checkpoints stop ``omni-server generate`` and ``serve`` before anything starts: one line naming the file and
the problem, exit status 2, no engine process, nothing loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omni_server.cli import main

pytest.importorskip("diffusers")


def _copy(family_dirs, tmp_path: Path) -> Path:
    return Path(shutil.copytree(family_dirs["flux"], tmp_path / "checkpoint"))


def _first_shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def _not_diffusers(directory: Path) -> tuple[Path, str]:
    shutil.rmtree(directory)
    directory.mkdir()
    (directory / "notes.txt").write_text("not a model")
    return directory, "not a model directory"


def _missing_shard(directory: Path) -> tuple[Path, str]:
    shard = _first_shard(directory / "transformer")
    shard.unlink()
    return shard, "missing"


def _truncated_shard(directory: Path) -> tuple[Path, str]:
    shard = _first_shard(directory / "transformer")
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard, "truncated"


def _corrupt_header(directory: Path) -> tuple[Path, str]:
    shard = _first_shard(directory / "vae")
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    return shard, "header"


def _unknown_class(directory: Path) -> tuple[Path, str]:
    index = directory / "model_index.json"
    data = json.loads(index.read_text())
    data["_class_name"] = "StableCascadePipeline"
    index.write_text(json.dumps(data))
    return index, "unknown _class_name 'StableCascadePipeline'"


def _config_disagrees(directory: Path) -> tuple[Path, str]:
    config = directory / "transformer" / "config.json"
    data = json.loads(config.read_text())
    data["num_layers"] += 1
    config.write_text(json.dumps(data))
    return directory / "transformer", "transformer_blocks.1"


CASES = [_not_diffusers, _missing_shard, _truncated_shard, _corrupt_header, _unknown_class, _config_disagrees]


@pytest.mark.parametrize("breakage", CASES, ids=[c.__name__.strip("_") for c in CASES])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_checkpoint_exits_2_with_one_line_naming_the_file(
    family_dirs, tmp_path, capsys, breakage, command
) -> None:
    directory = _copy(family_dirs, tmp_path)
    named, problem = breakage(directory)
    argv = (
        ["generate", "a cat", "--model", str(directory), "-o", str(tmp_path / "x.png")]
        if command == "generate"
        else ["serve", str(directory), "--port", "1"]
    )  # port 1 is never bound: the check comes first
    argv += ["--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("omni-server: error: ") and str(named) in lines[0] and problem in lines[0], lines[0]
    assert not (tmp_path / "x.png").exists()


def test_serve_with_a_bad_checkpoint_never_starts_an_engine(family_dirs, tmp_path, tools) -> None:
    directory = _copy(family_dirs, tmp_path)
    _truncated_shard(directory)
    port = tools.free_port()
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "serve", str(directory), "--device", "cpu", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "truncated" in result.stderr and "Uvicorn running" not in result.stderr, result.stderr
