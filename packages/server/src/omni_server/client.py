"""The API process's handle on the engine process: spawn, talk, watch, restart, stop.

Lifecycle: ``start()`` spawns the engine process (or adopts the one ``prestart_engine`` spawned before the server's
checks ran) and returns at once. An engine process first imports what loading needs, then waits for
``StartLoading``, which the client sends when it takes the process over, so those imports overlap the API process's
own start; the engine reports ``EngineReady`` only after load -> profile -> KV pool sizing -> warm-up. A reader
thread per engine process waits on the pipe *and* the process sentinel together, so the death of the engine (crash,
OOM-kill, SIGKILL) is seen within milliseconds. The engine also sends a ``Heartbeat`` every
``HEARTBEAT_INTERVAL_S``; an engine that is alive but silent for ``engine_heartbeat_timeout_s`` (frozen, SIGSTOPped,
swapped out) is *stalled*.

States (``state``): ``starting`` -> ``ready`` <-> ``stalled``; a ready engine that dies goes to
``restarting`` (a new engine process is spawned after an exponential backoff, at most ``engine_restarts``
times in a row; an engine that stays up for ``RESTART_BUDGET_RESET_S`` earns the budget back) and back to
``ready``, or to ``dead`` when the budget is spent; ``stopped`` after ``shutdown``. An engine that fails its
first start is ``dead`` at once. On the way to ``dead`` every pending request is answered first, then
``on_dead(reason)`` is called once: the server exits non-zero with the reason, so a supervisor restarts it.

One error channel: ``generate`` never raises. Every future it hands out is resolved exactly once with a
``RequestFinished``: the engine's answer, or an ``unavailable`` / ``timeout`` error made here (engine death,
``fail_pending``, ``finish_with_error``). ``shutdown`` leaves no engine process behind.

LoRA adapters: ``update_lora`` asks the engine to load or unload one and resolves with its answer; the client's
config holds the adapters served now (``lora_modules``), so an engine that restarts serves the same ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Literal

import msgspec

from omni_models import ResolvedRequest
from omni_server.config import LoRAModule, ServerConfig
from omni_server.protocol import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineStartupFailed,
    EngineStats,
    Heartbeat,
    LoadLoRAAdapter,
    LoRAAdapterUpdated,
    RequestError,
    RequestFinished,
    Shutdown,
    StartLoading,
    UnloadLoRAAdapter,
    decode_output,
    encode,
)

logger = logging.getLogger(__name__)

EngineState = Literal["starting", "ready", "stalled", "restarting", "dead", "stopped"]
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap; doubles per consecutive restart
RESTART_BUDGET_RESET_S = 60.0
_TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class EngineStartError(RuntimeError):
    """The engine failed its first start (or did not become ready in time); the message says why."""


class EngineProcess:
    """One spawned engine process: its pipe, a writer thread, a reader thread."""

    def __init__(self, config: ServerConfig, generation: int) -> None:
        from omni_server.engine_process import run_engine_process

        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe(duplex=True)
        self.generation = generation
        self.process = context.Process(
            target=run_engine_process,
            args=(child_conn, msgspec.msgpack.encode(config)),
            name="omni-server-engine",
            daemon=True,
        )
        # The engine takes orders from this process only: it starts with SIGINT/SIGTERM blocked (the mask is
        # inherited through fork and exec) and ignores them before unblocking, so a Ctrl-C or a signal to the
        # process group never interrupts it, even while it imports.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINAL_SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        child_conn.close()
        self.conn: Connection = parent_conn
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.ready_at: float | None = None
        self.last_heard = time.monotonic()

    def start_loading(self) -> None:
        """Let the engine load the model (until then it only imports; ``run_engine_process``)."""
        self.outbox.put(encode(StartLoading()))

    def write_loop(self) -> None:
        # A dedicated writer keeps the event loop from blocking when the pipe's buffer is full.
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                return

    def stop(self, timeout: float) -> None:
        """Ask the engine to stop, then kill it (it ignores SIGTERM by design); always reaps it."""
        if self.process.is_alive():
            self.outbox.put(encode(Shutdown()))
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.outbox.put(None)


def prestart_engine(config: ServerConfig) -> EngineProcess:
    """Spawn the first engine process before the server's checks run: it imports what loading needs meanwhile and
    loads nothing until an ``EngineClient`` given it as ``prestarted`` starts. ``stop(0)`` discards it (the checks
    failed)."""
    return EngineProcess(config, 0)


class EngineClient:
    """Spawns, talks to, watches, restarts and stops the engine process."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
        prestarted: EngineProcess | None = None,
    ) -> None:
        self._config = config
        self._prestarted = prestarted
        self._on_stats = on_stats
        self._on_restart = on_restart
        self._on_dead = on_dead
        self._ids = itertools.count()
        self._generations = itertools.count(0 if prestarted is None else prestarted.generation + 1)
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestFinished]]] = {}
        self._lora_calls: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, LoRAModule | str]] = {}
        self._lock = threading.Lock()
        self._first_start = threading.Event()  # set once the first engine is ready or failed
        self._engine: EngineProcess | None = None
        self._state: EngineState = "starting"
        self._consecutive_restarts = 0
        self.restarts = 0
        self.ready_info: EngineReady | None = None
        self.death_reason: str | None = None  # why the engine is not serving (latest death or start failure)
        self.last_stats: EngineStats | None = None

    # -- state -------------------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        state = self._state
        if state == "ready" and self.heartbeat_age_s > self._config.engine_heartbeat_timeout_s:
            return "stalled"
        return state

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def dead(self) -> bool:
        return self._state == "dead"

    @property
    def heartbeat_age_s(self) -> float:
        engine = self._engine
        return 0.0 if engine is None else time.monotonic() - engine.last_heard

    @property
    def engine_pid(self) -> int | None:
        engine = self._engine
        return engine.process.pid if engine is not None else None

    def unavailable_error(self) -> RequestError:
        """Why a request cannot be served now, as the one error type every answer carries."""
        state = self.state
        if state == "starting":
            return RequestError(
                kind="unavailable",
                code="engine_starting",
                message="the engine is still starting (loading, profiling or warming up); retry shortly",
            )
        if state == "stalled":
            return RequestError(
                kind="unavailable",
                code="engine_stalled",
                message=f"the engine has not answered for {self.heartbeat_age_s:.1f} s; retry shortly",
            )
        if state == "restarting":
            return RequestError(
                kind="unavailable",
                code="engine_restarting",
                message=f"the engine is restarting after it failed ({self.death_reason}); retry shortly",
            )
        if state == "stopped":
            return RequestError(kind="unavailable", code="server_shutting_down", message="the server is shutting down")
        return RequestError(
            kind="unavailable", code="engine_dead", message=f"the engine is not available: {self.death_reason}"
        )

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine process; readiness is reported asynchronously (see ``wait_ready``)."""
        self._spawn()

    def wait_ready(self, timeout: float) -> EngineReady:
        """Block until the first engine is ready; raise ``EngineStartError`` if it failed or timed out."""
        if not self._first_start.wait(timeout):
            raise EngineStartError(f"engine did not become ready within {timeout:.0f} s")
        if self.ready_info is None:
            raise EngineStartError(self.death_reason or "engine failed to start")
        return self.ready_info

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (no restart follows) and fail whatever is still pending with 503."""
        with self._lock:
            self._state = "stopped"
            engine = self._engine
        if engine is not None:
            engine.stop(timeout)
        self._first_start.set()
        self.fail_pending(self.unavailable_error())

    # -- requests ----------------------------------------------------------------------------------------

    def generate(self, request: ResolvedRequest) -> tuple[str, asyncio.Future[RequestFinished]]:
        """Submit one request; returns its id and a future resolved exactly once with its ``RequestFinished``."""
        loop = asyncio.get_running_loop()
        request_id = f"img-{next(self._ids)}-{time.monotonic_ns()}"
        future: asyncio.Future[RequestFinished] = loop.create_future()
        with self._lock:
            # Checked under the lock that a death holds while it fails every pending future, so a request is
            # either failed by it or refused here, never stranded.
            engine = self._engine
            if not self.ready or engine is None:
                future.set_result(RequestFinished(request_id=request_id, error=self.unavailable_error()))
                return request_id, future
            self._pending[request_id] = (loop, future)
        engine.outbox.put(encode(AddRequest(request_id, request)))
        return request_id, future

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop a request; its blocks are freed (its answer, if any, is ignored)."""
        engine = self._engine
        if engine is not None and self._state in ("ready", "stalled"):
            engine.outbox.put(encode(AbortRequest(request_id)))

    def finish_with_error(self, request_id: str, error: RequestError) -> None:
        """Answer one pending request with ``error`` now and abort it in the engine."""
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is not None:
            loop, future = entry
            loop.call_soon_threadsafe(_resolve, future, RequestFinished(request_id=request_id, error=error))
        self.abort(request_id)

    def fail_pending(self, error: RequestError) -> int:
        """Answer every pending request (and LoRA update) with ``error``; returns how many requests there were."""
        self._fail_lora_calls(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for request_id, (loop, future) in pending.items():
            try:
                loop.call_soon_threadsafe(_resolve, future, RequestFinished(request_id=request_id, error=error))
            except RuntimeError:  # the loop is already closed at interpreter shutdown
                pass
        return len(pending)

    # -- LoRA adapters ----------------------------------------------------------------------------------

    @property
    def lora_modules(self) -> list[LoRAModule]:
        """The adapters served now (``--lora-modules`` and runtime loads, in order)."""
        return list(self._config.lora_modules)

    def update_lora(self, change: LoRAModule | str) -> asyncio.Future[LoRAAdapterUpdated]:
        """Load ``change`` (a ``LoRAModule``) or unload the adapter it names (a ``str``) in the engine; the future
        resolves with the engine's answer (or an ``unavailable`` error), and on success ``lora_modules`` follows."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[LoRAAdapterUpdated] = loop.create_future()
        call_id = f"lora-{next(self._ids)}-{time.monotonic_ns()}"
        if isinstance(change, LoRAModule):
            message: LoadLoRAAdapter | UnloadLoRAAdapter = LoadLoRAAdapter(call_id, change.name, change.path)
        else:
            message = UnloadLoRAAdapter(call_id, change)
        with self._lock:
            engine = self._engine
            if not self.ready or engine is None:
                future.set_result(LoRAAdapterUpdated(call_id=call_id, error=self.unavailable_error()))
                return future
            self._lora_calls[call_id] = (loop, future, change)
        engine.outbox.put(encode(message))
        return future

    def _lora_updated(self, message: LoRAAdapterUpdated) -> None:
        with self._lock:
            entry = self._lora_calls.pop(message.call_id, None)
            if entry is not None and message.error is None:
                change = entry[2]
                name = change if isinstance(change, str) else change.name
                modules = [m for m in self._config.lora_modules if m.name != name]
                if isinstance(change, LoRAModule):
                    modules.append(change)
                self._config = msgspec.structs.replace(self._config, lora_modules=modules)
        if entry is not None:
            entry[0].call_soon_threadsafe(_resolve, entry[1], message)

    def _fail_lora_calls(self, error: RequestError) -> None:
        with self._lock:
            calls, self._lora_calls = self._lora_calls, {}
        for call_id, (loop, future, _) in calls.items():
            try:
                loop.call_soon_threadsafe(_resolve, future, LoRAAdapterUpdated(call_id=call_id, error=error))
            except RuntimeError:
                pass

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- engine processes --------------------------------------------------------------------------------

    def _spawn(self) -> None:
        engine, self._prestarted = self._prestarted, None
        if engine is None:
            engine = EngineProcess(self._config, next(self._generations))
        engine.start_loading()
        with self._lock:
            if self._state == "stopped":
                engine.stop(0.0)
                return
            self._engine = engine
        threading.Thread(target=self._read_loop, args=(engine,), name="engine-reader", daemon=True).start()
        threading.Thread(target=engine.write_loop, name="engine-writer", daemon=True).start()

    def _read_loop(self, engine: EngineProcess) -> None:
        conn, sentinel = engine.conn, engine.process.sentinel
        reason = "engine process exited"
        while True:
            ready = wait([conn, sentinel])
            if conn in ready:
                try:
                    message = decode_output(conn.recv_bytes())
                except (EOFError, OSError):
                    break
                engine.last_heard = time.monotonic()
                if isinstance(message, EngineStartupFailed):
                    reason = f"engine failed to start: {message.message}"
                    break
                self._dispatch(engine, message)
            elif sentinel in ready:
                while conn.poll(0):  # what the engine wrote before exiting
                    try:
                        self._dispatch(engine, decode_output(conn.recv_bytes()))
                    except (EOFError, OSError):
                        break
                break
        engine.process.join(5.0)
        if reason == "engine process exited":
            reason = f"engine process exited unexpectedly (exit code {engine.process.exitcode})"
        engine.outbox.put(None)
        self._on_engine_exit(engine, reason)

    def _dispatch(self, engine: EngineProcess, message: object) -> None:
        if isinstance(message, RequestFinished):
            with self._lock:
                entry = self._pending.pop(message.request_id, None)
            if entry is not None:
                loop, future = entry
                loop.call_soon_threadsafe(_resolve, future, message)
        elif isinstance(message, EngineStats):
            self._report_stats(message)
        elif isinstance(message, LoRAAdapterUpdated):
            self._lora_updated(message)
        elif isinstance(message, EngineReady):
            with self._lock:
                if self._engine is not engine or self._state == "stopped":
                    return
                engine.ready_at = time.monotonic()
                restarted = self.ready_info is not None
                self.ready_info = message
                self._state = "ready"
            # The engine starts idle with an empty pool; stats arrive with its first iteration.
            self._report_stats(
                EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=message.kv_blocks_total)
            )
            if restarted:
                logger.warning("engine restarted (pid %s) and ready", message.pid)
            self._first_start.set()
        elif isinstance(message, Heartbeat):
            pass  # last_heard is all it carries

    def _report_stats(self, stats: EngineStats) -> None:
        self.last_stats = stats
        if self._on_stats is not None:
            self._on_stats(stats)

    def _on_engine_exit(self, engine: EngineProcess, reason: str) -> None:
        with self._lock:
            if self._engine is not engine or self._state in ("stopped", "dead"):
                return
            self.death_reason = reason
            first_start_failed = self.ready_info is None
            if engine.ready_at is not None and time.monotonic() - engine.ready_at >= RESTART_BUDGET_RESET_S:
                self._consecutive_restarts = 0
            can_restart = not first_start_failed and self._consecutive_restarts < self._config.engine_restarts
            self._state = "restarting" if can_restart else "dead"
            if not can_restart and not first_start_failed:
                self.death_reason = (
                    f"{reason}; not restarted: --engine-restarts {self._config.engine_restarts} "
                    f"allows no more restarts in a row ({self._consecutive_restarts} so far)"
                )
            delay = min(RESTART_BACKOFF_S[0] * 2**self._consecutive_restarts, RESTART_BACKOFF_S[1])
            if can_restart:
                self._consecutive_restarts += 1
        logger.error("%s", reason)
        total = self.last_stats.kv_blocks_total if self.last_stats is not None else 0
        self._report_stats(EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=total))
        self.fail_pending(
            RequestError(kind="unavailable", code="engine_dead", message=f"the engine is not available: {reason}")
        )
        if not can_restart and self._on_dead is not None:
            self._on_dead(self.death_reason)
        if first_start_failed:
            self._first_start.set()
            return
        if can_restart:
            logger.warning(
                "restarting the engine in %.1f s (restart %d of at most %d in a row)",
                delay,
                self._consecutive_restarts,
                self._config.engine_restarts,
            )
            threading.Thread(target=self._restart_after, args=(delay,), name="engine-restart", daemon=True).start()

    def _restart_after(self, delay: float) -> None:
        time.sleep(delay)
        with self._lock:
            if self._state != "restarting":
                return
            self.restarts += 1
        if self._on_restart is not None:
            self._on_restart()
        self._spawn()


def _resolve(future: asyncio.Future[RequestFinished], result: RequestFinished) -> None:
    if not future.done():
        future.set_result(result)
