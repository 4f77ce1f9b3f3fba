"""A real ``omni-server serve`` process on a loopback port, started once per test module.

Every wait is bounded; teardown stops the server with SIGTERM (then SIGKILL) and
checks that no process of its tree is left behind. This folder goes on ``sys.path`` for ``edit_inputs``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may contain spaces.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in /metrics text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        sample, value = line.rsplit(" ", 1)
        sample_name = sample.split("{", 1)[0]
        if sample_name != name:
            continue
        if all(f'{key}="{val}"' in sample for key, val in labels.items()):
            return float(value)
    return 0.0


@dataclass
class ServerHandle:
    process: subprocess.Popen
    url: str
    log_path: Path
    args: list[str] = field(default_factory=list)
    # Bodies of the non-200 /health answers seen while the engine was starting.
    starting_health: list[dict] = field(default_factory=list)

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def engine_pid(self) -> int:
        # multiprocessing's spawn context also starts a resource tracker child; the engine is the spawned one.
        engines = [
            pid
            for pid in child_pids(self.process.pid)
            if pid_alive(pid) and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(engines) == 1, f"expected one engine child process, found {engines}"
        return engines[0]

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_running(self, count: int, timeout_s: float = 30.0, *, waiting: int = 0) -> None:
        """Block until /metrics shows at least ``count`` running requests (and ``waiting`` queued in the engine);
        fail the test after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.metrics()
            if (
                metric(text, "omni:num_requests_running") >= count
                and metric(text, "omni:num_requests_waiting") >= waiting
            ):
                return
            assert time.monotonic() < deadline, "requests never started running"
            time.sleep(0.05)

    def kill_and_watch_health(self, pid: int, window_s: float = 1.0) -> tuple[int, float, float]:
        """SIGKILL ``pid``, then poll /health until it answers non-200 or ``window_s`` has passed.

        Returns (the last /health status, the monotonic time of the kill, seconds from the kill to that status).
        """
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while time.monotonic() - killed < window_s:
            status = httpx.get(f"{self.url}/health", timeout=1).status_code
            if status != 200:
                break
            time.sleep(0.02)
        return status, killed, time.monotonic() - killed

    def stop(self) -> None:
        """SIGTERM, bounded wait, SIGKILL; then assert the whole tree is gone."""
        tree = [self.process.pid, *child_pids(self.process.pid)]
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        leftovers = [pid for pid in tree if pid_alive(pid)]
        assert not leftovers, f"processes left behind after stopping the server: {leftovers}"


def start_server(tmp_dir: Path, *args: str, env: dict[str, str] | None = None) -> ServerHandle:
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    model = os.environ.get("OMNI_SERVER_TEST_MODEL")  # optional: run the suite against another local model
    model_args = [model, "--served-model-name", "omni-shapes-tiny"] if model else []
    argv = [
        sys.executable,
        "-m",
        "omni_server",
        "serve",
        *model_args,
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log_path, "wb") as log:
        # Its own process group, so a test can signal the group (as a terminal or a container runtime does).
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
    handle = ServerHandle(process, f"http://127.0.0.1:{port}", log_path, argv)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} during start-up:\n{handle.log()}")
        try:
            response = httpx.get(f"{handle.url}/health", timeout=2)
        except httpx.TransportError:
            pass
        else:
            if response.status_code == 200:
                return handle
            handle.starting_health.append({"status": response.status_code, **response.json()})
        time.sleep(0.2)
    handle.stop()
    raise RuntimeError(f"server not healthy within {START_TIMEOUT_S} s:\n{handle.log()}")


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerHandle]]:
    started: list[ServerHandle] = []

    def factory(*args: str, env: dict[str, str] | None = None) -> ServerHandle:
        handle = start_server(tmp_path_factory.mktemp("server"), *args, env=env)
        started.append(handle)
        return handle

    yield factory
    for handle in started:
        if handle.process.poll() is None:
            handle.stop()


class Tools:
    """Helpers for test modules (importlib import mode keeps conftest out of their namespace)."""

    free_port = staticmethod(free_port)
    child_pids = staticmethod(child_pids)
    pid_alive = staticmethod(pid_alive)
    rss_bytes = staticmethod(rss_bytes)
    metric = staticmethod(metric)


@pytest.fixture(scope="session")
def tools() -> type[Tools]:
    return Tools


# --- the real families: tiny random-weight diffusers checkpoints written here (no hub) ------------------------------


def image_psnr(a, b) -> float:
    """PSNR in dB between two 8-bit images (PIL or arrays); inf when identical."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


Tools.psnr = staticmethod(image_psnr)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"flux": FLUX.1-dev dir, "qwen-image": Qwen-Image dir}``: tiny configs, random weights, sharded."""
    pytest.importorskip("diffusers")
    from omni_models import synthetic

    dirs = {}
    for family, build in (("flux", synthetic.flux_components), ("qwen-image", synthetic.qwen_image_components)):
        directory = tmp_path_factory.mktemp(family)
        dirs[family] = synthetic.save_checkpoint(family, build("tiny"), directory, max_shard_size="40KB")
    return dirs


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Headless Chromium through the system chromedriver; nothing leaves the machine.

    Passing the driver's path skips Selenium Manager (which would look a driver up online); its statistics are
    off and it is offline in case anything calls it; the browser resolves no host but the loopback server.
    """
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip(
            "needs Chromium and its driver (Debian: apt-get install chromium chromium-driver; "
            "tests/run_matrix.sh installs them)"
        )
    monkeypatch.setenv("SE_AVOID_STATS", "true")
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1, EXCLUDE localhost",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
