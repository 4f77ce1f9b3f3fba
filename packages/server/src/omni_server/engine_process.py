"""Entry point and main loop of the engine process (the process that owns the accelerator).

The loop alternates between draining messages from the API process and running
one engine iteration; it blocks on the pipe only when there is no work. It exits
when the API process asks it to, when the pipe closes (the API process is gone),
or, through ``PR_SET_PDEATHSIG``, when the API process dies while a step runs,
so a killed server never leaves an engine process holding the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

import msgspec

from omni_server.config import ServerConfig
from omni_server.protocol import (
    AbortRequest,
    AddRequest,
    EngineStartupFailed,
    Shutdown,
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


def run_engine_process(conn: Connection, config_bytes: bytes) -> None:
    """Start the engine, report readiness, then serve requests until told to stop."""
    parent_pid = os.getppid()
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    config = msgspec.msgpack.decode(config_bytes, type=ServerConfig)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s [engine] %(message)s"
    )
    from omni_server.engine import build_engine

    try:
        engine = build_engine(config)
    except Exception as exc:  # report any start-up failure to the API process, then exit
        logger.exception("engine start-up failed")
        conn.send_bytes(encode(EngineStartupFailed(f"{type(exc).__name__}: {exc}")))
        conn.close()
        return
    conn.send_bytes(encode(engine.ready_message()))

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
                engine.add(message.request_id, message.params)
            elif isinstance(message, AbortRequest):
                engine.abort(message.request_id)
            elif isinstance(message, Shutdown):
                raise _ShutdownRequested

    try:
        while True:
            drain_inputs(block=not engine.has_work())
            for output in engine.step():
                conn.send_bytes(encode(output))
    except (_ParentGone, _ShutdownRequested):
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        engine.close()
        conn.close()
