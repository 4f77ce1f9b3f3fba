"""``omni-server serve``: run the API process (uvicorn) whose lifespan owns the engine process."""

from __future__ import annotations

import logging

from omni_server.config import ServerConfig

logger = logging.getLogger("omni_server.serve")


def serve(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM; returns 1 if the engine failed to start, else 0."""
    import uvicorn

    from omni_server.api import create_app

    start_failures: list[str] = []

    def on_engine_failure(reason: str) -> None:
        start_failures.append(reason)
        server.should_exit = True

    app = create_app(config, on_engine_failure=on_engine_failure)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.log_level == "debug", timeout_graceful_shutdown=5,
    ))
    server.run()
    if start_failures:
        logger.error("exiting: %s", start_failures[0])
        return 1
    return 0
