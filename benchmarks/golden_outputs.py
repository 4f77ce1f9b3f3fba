"""Golden outputs: the bytes omni-server writes for fixed seeds, through the CLI and the HTTP API.

A refactor that must not change behaviour records them before (``--record golden.json``) and checks them after
(``--check golden.json``): every PNG and WAV must come out byte for byte the same. Cases:

- the shipped ``omni-shapes-tiny``: bf16/fp32 default, FP8 online, FP8 from the cache (miss, then hit), layerwise
  offload, ``n=2``;
- tiny random FLUX.1-dev and Qwen-Image checkpoints (``omni_models.synthetic``, fixed weight seeds): default, FP8,
  offload, FP8 from the cache;
- the shipped ``omni-tones-tiny`` (WAV);
- the same models through ``omni-server serve`` and ``POST /v1/images/generations`` / ``/v1/audio/speech``.

CPU only; it runs in the ``test.server`` environment (everything installed), in a few minutes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "a red circle at the top left on a blue background"
LYRICS = "[verse]\nla la la"
CAPTION = "a calm piano melody at 90 BPM in C major"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cli(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "generate", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"omni-server generate {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")


def cli_cases(work: Path, checkpoints: dict[str, Path]) -> dict[str, str]:
    out: dict[str, str] = {}

    def run(name: str, *args: str, files: tuple[str, ...] = ("out.png",)) -> None:
        case = work / name
        case.mkdir(parents=True, exist_ok=True)
        cli(*args, cwd=case)
        for file in files:
            out[f"cli/{name}/{file}"] = sha((case / file).read_bytes())

    seed = ("--image-seed", "7")
    run("shapes", PROMPT, *seed, "--device", "cpu")
    run("shapes-n2", PROMPT, *seed, "-n", "2", "--device", "cpu", files=("out-0.png", "out-1.png"))
    run("shapes-guidance1", PROMPT, *seed, "--guidance-scale", "1", "--steps", "5", "--device", "cpu")
    run("shapes-fp8", PROMPT, *seed, "--quantization", "fp8", "--device", "cpu")
    cache = work / "fp8-cache-shapes"
    run(
        "shapes-fp8-cache-miss",
        PROMPT,
        *seed,
        "--quantization",
        "fp8",
        "--fp8-cache-dir",
        str(cache),
        "--device",
        "cpu",
    )
    run(
        "shapes-fp8-cache-hit", PROMPT, *seed, "--quantization", "fp8", "--fp8-cache-dir", str(cache), "--device", "cpu"
    )
    run("shapes-offload", PROMPT, *seed, "--enable-layerwise-offload", "--device", "cpu")
    for family, directory in checkpoints.items():
        model = ("--model", str(directory), "--size", "32x32", "--steps", "4", "--device", "cpu")
        run(f"{family}", "a red circle", *model, *seed)
        run(
            f"{family}-n2-neg",
            "a red circle",
            *model,
            *seed,
            "-n",
            "2",
            "--negative-prompt",
            "blurry",
            "--true-cfg-scale",
            "3",
            files=("out-0.png", "out-1.png"),
        )
        run(f"{family}-fp8", "a red circle", *model, *seed, "--quantization", "fp8")
        fcache = work / f"fp8-cache-{family}"
        run(
            f"{family}-fp8-cache-miss",
            "a red circle",
            *model,
            *seed,
            "--quantization",
            "fp8",
            "--fp8-cache-dir",
            str(fcache),
        )
        run(
            f"{family}-fp8-cache-hit",
            "a red circle",
            *model,
            *seed,
            "--quantization",
            "fp8",
            "--fp8-cache-dir",
            str(fcache),
        )
        run(f"{family}-offload", "a red circle", *model, *seed, "--enable-layerwise-offload")
    run(
        "tones",
        CAPTION,
        "--model",
        "omni-tones-tiny",
        "--lyrics",
        LYRICS,
        "--image-seed",
        "3",
        "-o",
        "song.wav",
        "--device",
        "cpu",
        files=("song.wav",),
    )
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, work: Path, *args: str) -> None:
        self.port = free_port()
        self.log = work / f"server-{self.port}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "omni_server", "serve", *args, "--device", "cpu", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def http_cases(work: Path, checkpoints: dict[str, Path]) -> dict[str, str]:
    import httpx

    out: dict[str, str] = {}
    images = [
        ("shapes", ("omni-shapes-tiny",), {"prompt": PROMPT, "seed": 7, "n": 2}),
        ("shapes-fp8", ("omni-shapes-tiny", "--quantization", "fp8"), {"prompt": PROMPT, "seed": 7}),
    ]
    for family, directory in checkpoints.items():
        body = {"prompt": "a red circle", "seed": 7, "n": 2, "size": "32x32", "num_inference_steps": 4}
        images.append((family, (str(directory),), body))
        images.append(
            (f"{family}-neg", (str(directory),), {**body, "n": 1, "negative_prompt": "blurry", "true_cfg_scale": 3.0})
        )
    for name, args, body in images:
        server = Server(work, *args)
        try:
            server.wait()
            response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=600)
            response.raise_for_status()
            for i, item in enumerate(response.json()["data"]):
                out[f"http/{name}/{i}.png"] = sha(base64.b64decode(item["b64_json"]))
        finally:
            server.stop()
    server = Server(work, "omni-tones-tiny")
    try:
        server.wait()
        response = httpx.post(
            f"{server.url}/v1/audio/speech",
            timeout=600,
            json={"model": "omni-tones-tiny", "input": LYRICS, "instructions": CAPTION, "seed": 3},
        )
        response.raise_for_status()
        out["http/tones/song.wav"] = sha(response.content)
    finally:
        server.stop()
    return out


def build_checkpoints(work: Path) -> dict[str, Path]:
    from omni_models.synthetic import flux_components, qwen_image_components, save_checkpoint

    checkpoints = {}
    for family, components in (
        ("flux", flux_components("tiny", seed=11)),
        ("qwen-image", qwen_image_components("tiny", seed=12)),
    ):
        checkpoints[family] = save_checkpoint(family, components, work / f"ckpt-{family}")
    return checkpoints


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", type=Path, help="write the digests to this JSON file")
    group.add_argument("--check", type=Path, help="compare the digests with this JSON file")
    parser.add_argument("--only", choices=["cli", "http"], default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="omni-golden-") as tmp:
        work = Path(tmp)
        checkpoints = build_checkpoints(work)
        digests: dict[str, str] = {}
        if args.only in (None, "cli"):
            digests.update(cli_cases(work, checkpoints))
        if args.only in (None, "http"):
            digests.update(http_cases(work, checkpoints))
    if args.record:
        args.record.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(digests)} digests in {args.record}")
        return 0
    expected = json.loads(args.check.read_text())
    changed = [k for k in digests if k in expected and expected[k] != digests[k]]
    missing = [k for k in expected if k not in digests and (args.only is None or k.startswith(args.only))]
    for key in changed:
        print(f"CHANGED {key}")
    for key in missing:
        print(f"MISSING {key}")
    print(
        f"{len(digests) - len(changed)} of {len(digests)} digests equal; {len(changed)} changed, {len(missing)} missing"
    )
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
