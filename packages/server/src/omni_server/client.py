"""The API process's handle on the engine process.

Lifecycle: ``start()`` spawns the engine process and returns at once; the engine
reports ``EngineReady`` only after load -> profile -> KV pool sizing -> warm-up,
and ``ready`` flips then. A reader thread waits on the pipe *and* the process
sentinel together, so the death of the engine process (crash, OOM-kill, SIGKILL)
is seen within milliseconds: ``dead`` flips and every in-flight request is
failed with ``EngineDeadError`` at once, which the HTTP layer answers with 503.

Invariant: every future handed out by ``generate`` is resolved exactly once
(result, error, or engine death), and ``shutdown`` leaves no engine process behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import msgspec

from omni_server.config import ServerConfig
from omni_server.protocol import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineStartupFailed,
    EngineStats,
    GenerationParams,
    RequestFinished,
    Shutdown,
    decode_output,
    encode,
)

logger = logging.getLogger(__name__)


class EngineNotReadyError(RuntimeError):
    """The engine is still starting (loading, profiling or warming up)."""


class EngineDeadError(RuntimeError):
    """The engine process has exited; no request can be served any more."""


class EngineClient:
    """Spawns, talks to, watches and stops one engine process."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        on_stats: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self._config = config
        self._on_stats = on_stats
        self._ids = itertools.count()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestFinished]]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._ready_event = threading.Event()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._shutting_down = False
        self.ready_info: EngineReady | None = None
        self.death_reason: str | None = None
        self.last_stats: EngineStats | None = None

    # -- state -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.ready_info is not None and self.death_reason is None

    @property
    def dead(self) -> bool:
        return self.death_reason is not None

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine process; readiness is reported asynchronously (see ``wait_ready``)."""
        from omni_server.engine_process import run_engine_process

        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(
            target=run_engine_process,
            args=(child_conn, msgspec.msgpack.encode(self._config)),
            name="omni-server-engine",
            daemon=True,
        )
        process.start()
        child_conn.close()
        self._process, self._conn = process, parent_conn
        threading.Thread(target=self._read_loop, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="engine-writer", daemon=True).start()

    def wait_ready(self, timeout: float) -> EngineReady:
        """Block until the engine is ready; raise ``EngineDeadError`` if it failed or died."""
        if not self._ready_event.wait(timeout):
            raise EngineDeadError(f"engine did not become ready within {timeout:.0f} s")
        if self.ready_info is None or self.dead:
            raise EngineDeadError(self.death_reason or "engine failed to start")
        return self.ready_info

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, then terminate and finally kill it; always reaps it."""
        self._shutting_down = True
        process = self._process
        if process is None:
            return
        if process.is_alive():
            self._outbox.put(encode(Shutdown()))
            process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
        self._outbox.put(None)
        self._mark_dead("engine shut down")

    # -- requests --------------------------------------------------------------------

    def generate(self, params: GenerationParams) -> tuple[str, asyncio.Future[RequestFinished]]:
        """Submit one request; returns its id and a future resolved with its ``RequestFinished``."""
        if self.ready_info is None and not self.dead:
            raise EngineNotReadyError("the engine is still starting")
        loop = asyncio.get_running_loop()
        request_id = f"img-{next(self._ids)}-{time.monotonic_ns()}"
        future: asyncio.Future[RequestFinished] = loop.create_future()
        with self._lock:
            # Checked under the lock that _mark_dead holds while it fails every pending future, so a
            # request is either failed by it or refused here, never stranded.
            if self.death_reason is not None:
                raise EngineDeadError(self.death_reason)
            self._pending[request_id] = (loop, future)
        self._outbox.put(encode(AddRequest(request_id, params)))
        return request_id, future

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop a request; its blocks are freed and it finishes ``aborted``."""
        if not self.dead:
            self._outbox.put(encode(AbortRequest(request_id)))

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- threads ---------------------------------------------------------------------

    def _write_loop(self) -> None:
        # A dedicated writer keeps the event loop from blocking when the engine is busy
        # in a long step and the pipe's buffer is full.
        assert self._conn is not None
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                return

    def _read_loop(self) -> None:
        assert self._conn is not None and self._process is not None
        conn, sentinel = self._conn, self._process.sentinel
        reason = "engine process exited"
        while True:
            ready = wait([conn, sentinel])
            if conn in ready:
                try:
                    message = decode_output(conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if isinstance(message, EngineStartupFailed):
                    reason = f"engine failed to start: {message.message}"
                    break
                self._dispatch(message)
            elif sentinel in ready:
                # Drain what the engine wrote before exiting, then declare it dead.
                while conn.poll(0):
                    try:
                        self._dispatch(decode_output(conn.recv_bytes()))
                    except (EOFError, OSError):
                        break
                break
        self._process.join(5.0)
        exitcode = self._process.exitcode
        if not self._shutting_down and reason == "engine process exited":
            reason = f"engine process exited unexpectedly (exit code {exitcode})"
        self._mark_dead(reason)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, RequestFinished):
            with self._lock:
                entry = self._pending.pop(message.request_id, None)
            if entry is not None:
                loop, future = entry
                loop.call_soon_threadsafe(_resolve, future, message, None)
        elif isinstance(message, EngineStats):
            self.last_stats = message
            if self._on_stats is not None:
                self._on_stats(message)
        elif isinstance(message, EngineReady):
            self.ready_info = message
            # The engine starts idle with an empty pool; stats arrive with its first iteration.
            self._dispatch(EngineStats(running=0, waiting=0, kv_blocks_used=0,
                                       kv_blocks_total=message.kv_blocks_total))
            self._ready_event.set()

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self.death_reason is not None:
                return
            self.death_reason = reason
            pending, self._pending = self._pending, {}
        self._ready_event.set()
        if not self._shutting_down:
            logger.error("%s", reason)
        for loop, future in pending.values():
            try:
                loop.call_soon_threadsafe(_resolve, future, None, EngineDeadError(reason))
            except RuntimeError:  # the loop is already closed at interpreter shutdown
                pass


def _resolve(
    future: asyncio.Future[RequestFinished], result: RequestFinished | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
