"""Entry point and main loop of the engine process (the process that owns the accelerator).

Start: it imports what loading the model needs (``omni_models.registry.import_for_load``), then waits for the
API process's ``StartLoading`` (its checks passed) before it reads any weights, so the imports overlap the API
process's start (``omni_server.client.prestart_engine``); a ``Shutdown`` or a closed pipe instead ends it.

The loop alternates between draining messages from the API process and running
one engine iteration; it blocks on the pipe only when there is no work. It exits
when the API process asks it to, when the pipe closes (the API process is gone),
or, through ``PR_SET_PDEATHSIG``, when the API process dies while a step runs,
so a killed server never leaves an engine process holding the GPU.

The engine takes orders from the API process only: it ignores SIGINT and SIGTERM (a Ctrl-C in the
terminal or a signal to the process group reaches the API process, which drains and then sends
``Shutdown``). A heartbeat thread sends ``Heartbeat`` every ``HEARTBEAT_INTERVAL_S`` so the API process
can tell a frozen engine from a busy one. Torch's intra-op threads are sized from the CPUs this process
may use (``omni_server.cpu_budget``) before torch is imported.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection

import msgspec

from omni_server.config import ServerConfig
from omni_server.cpu_budget import configure_intra_op_threads
from omni_server.protocol import (
    HEARTBEAT_INTERVAL_S,
    AbortRequest,
    AddRequest,
    EngineStartupFailed,
    Heartbeat,
    LoadLoRAAdapter,
    Shutdown,
    StartLoading,
    UnloadLoRAAdapter,
    decode_input,
    encode,
)

logger = logging.getLogger("omni_server.engine")

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_S = 1.0


class _ParentGone(Exception):
    """The API process closed its end of the pipe."""


class _ShutdownRequested(Exception):
    """The API process asked the engine to stop."""


def _die_with_parent() -> None:
    # Linux only; elsewhere the closed pipe (checked every iteration) still ends the loop.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _ignore_terminal_signals() -> None:
    # The API process spawned us with SIGINT/SIGTERM blocked; ignore them, then let pending ones be discarded.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


class _Sender:
    """The engine's end of the pipe, shared by the main loop and the heartbeat thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self._lock:
            self._conn.send_bytes(data)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _heartbeat(sender: _Sender, stop: threading.Event) -> None:
    beat = encode(Heartbeat())
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        try:
            sender.send(beat)
        except (OSError, ValueError):
            return


def _import_for_load(config: ServerConfig) -> list[warnings.WarningMessage]:
    """Import what loading the model needs (torch, the engine, the model kind's modules) while the API process still
    checks it; a problem is left to those checks, which name it, and to the load. Silent: the warnings the imports
    raise are returned, to be shown once loading starts (an engine whose checks fail prints nothing)."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            import omni_models.registry
            import omni_server.engine  # noqa: F401

            omni_models.registry.import_for_load(config.model)
        except Exception:
            logger.debug("importing for %s failed; the load will say why", config.model, exc_info=True)
    return caught


def _wait_for_start(conn: Connection, parent_pid: int) -> bool:
    """Block until the API process says ``StartLoading`` (True) or ``Shutdown``, or is gone (False)."""
    while True:
        try:
            if not conn.poll(_IDLE_POLL_S):
                if os.getppid() != parent_pid:
                    return False
                continue
            message = decode_input(conn.recv_bytes())
        except (EOFError, OSError):
            return False
        if isinstance(message, StartLoading):
            return True
        if isinstance(message, Shutdown):
            return False


def run_engine_process(conn: Connection, config_bytes: bytes) -> None:
    """Start the engine, report readiness, then serve requests until told to stop."""
    _ignore_terminal_signals()
    parent_pid = os.getppid()
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    config = msgspec.msgpack.decode(config_bytes, type=ServerConfig)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s [engine] %(message)s")
    threads = configure_intra_op_threads(os.environ)
    sender = _Sender(conn)
    stop_heartbeat = threading.Event()
    threading.Thread(target=_heartbeat, args=(sender, stop_heartbeat), name="engine-heartbeat", daemon=True).start()
    started = time.monotonic()
    import_warnings = _import_for_load(config)
    imported = time.monotonic()
    if not _wait_for_start(conn, parent_pid):
        stop_heartbeat.set()
        sender.close()
        return
    logger.info("torch intra-op threads: %d (%s)", threads.count, threads.source)
    logger.info(
        "imported for loading in %.1f s, then waited %.1f s for the API process's checks",
        imported - started,
        time.monotonic() - imported,
    )
    for caught in import_warnings:
        warnings.showwarning(caught.message, caught.category, caught.filename, caught.lineno)
    from omni_server.engine import build_engine

    try:
        engine = build_engine(config)
    except Exception as exc:  # report any start-up failure to the API process, then exit
        logger.exception("engine start-up failed")
        stop_heartbeat.set()
        sender.send(encode(EngineStartupFailed(f"{type(exc).__name__}: {exc}")))
        conn.close()
        return
    sender.send(encode(engine.ready_message()))
    sender.send(encode(engine.stats()))  # /metrics shows the start-up's figures (compiled graphs) before any request

    def drain_inputs(block: bool) -> None:
        timeout = _IDLE_POLL_S if block else 0.0
        while True:
            try:
                if not conn.poll(timeout):
                    if block and os.getppid() != parent_pid:
                        raise _ParentGone
                    if block and not engine.has_work():
                        continue
                    return
                message = decode_input(conn.recv_bytes())
            except (EOFError, OSError):
                raise _ParentGone from None
            timeout = 0.0
            if isinstance(message, AddRequest):
                engine.add(message.request_id, message.request)
            elif isinstance(message, AbortRequest):
                engine.abort(message.request_id)
            elif isinstance(message, (LoadLoRAAdapter, UnloadLoRAAdapter)):
                sender.send(encode(engine.update_lora(message)))
            elif isinstance(message, Shutdown):
                raise _ShutdownRequested

    try:
        while True:
            drain_inputs(block=not engine.has_work())
            for output in engine.step():
                sender.send(encode(output))
    except (_ParentGone, _ShutdownRequested):
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stop_heartbeat.set()
        engine.close()
        sender.close()
