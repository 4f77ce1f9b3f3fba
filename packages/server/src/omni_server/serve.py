"""``omni-server serve``: run the API process (uvicorn) whose lifespan owns the engine process.

Graceful drain: the first SIGTERM or SIGINT (to the process or to its process group; the engine ignores
both and takes orders from this process only) starts the drain: new requests get 503 in the OpenAI shape,
``/health`` turns 503, requests in flight run to completion for up to ``--shutdown-timeout`` seconds, and
whatever is still in flight then gets 503 ``server_shutting_down``. Then uvicorn closes the connections,
the lifespan stops the engine, and the process exits 0. A second signal skips the rest of the wait.

An engine that fails its first start, or dies once more than ``--engine-restarts`` allows (the engine client
reaches ``dead`` and calls ``on_engine_failure``), ends the server instead: whatever was in flight has been
answered 503, uvicorn shuts down and the process exits 1, so a supervisor (systemd, Kubernetes) restarts it, as
vLLM's server exits when its engine dies.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Generator
from types import FrameType
from typing import TYPE_CHECKING, Any

from omni_server.config import ServerConfig
from omni_server.protocol import RequestError

if TYPE_CHECKING:
    from omni_server.client import EngineProcess

logger = logging.getLogger("omni_server.serve")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(config: ServerConfig, *, engine: EngineProcess | None = None) -> int:
    """Serve until SIGINT/SIGTERM (returns 0), or until the engine is dead (returns 1). ``engine``: the engine
    process ``prestart_engine`` spawned for this config (else the app spawns one)."""
    import uvicorn

    from omni_server.api import DrainState, create_app
    from omni_server.http_protocol import protocol_class

    engine_failures: list[str] = []
    drain = DrainState()

    def on_engine_failure(reason: str) -> None:
        """The engine failed to start, or is dead (``EngineClient``'s ``on_dead``, after it answered every request
        503): stop serving and exit 1."""
        engine_failures.append(reason)
        server.should_exit = True

    app = create_app(config, on_engine_failure=on_engine_failure, drain=drain, engine=engine)

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with a drain before its own shutdown, and no re-raised signal at exit."""

        drain_deadline: float | None = None
        skip_wait = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.drain_deadline is None:
                logger.info("received %s: draining (at most %g s)", signal.Signals(sig).name, config.shutdown_timeout_s)
                self.drain_deadline = time.monotonic() + config.shutdown_timeout_s
                drain.start()
            else:
                self.skip_wait = True

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and not self.should_exit:
                client = app.state.engine_client
                in_flight = app.state.in_flight
                if in_flight == 0 or self.skip_wait or time.monotonic() >= self.drain_deadline:
                    answered = client.fail_pending(
                        RequestError(
                            kind="unavailable",
                            code="server_shutting_down",
                            message=f"the server shut down before this request finished (--shutdown-timeout "
                            f"{config.shutdown_timeout_s:g} s)",
                        )
                    )
                    logger.info("drain done: %d request(s) still in flight answered 503", answered)
                    self.should_exit = True
            return await super().on_tick(counter)

    uvicorn_config: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        http=protocol_class(config),
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_graceful_shutdown=5,
        server_header=False,
    )
    server = DrainingServer(uvicorn.Config(app, **uvicorn_config))
    server.run()
    if engine_failures:
        logger.error("exiting: %s", engine_failures[0])
        return 1
    return 0
