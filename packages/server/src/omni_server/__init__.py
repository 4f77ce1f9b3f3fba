"""The omni-server CLI and an OpenAI-compatible HTTP server composing omni's libraries into one GPU pipeline.

Entry points: ``omni-server serve`` / ``omni-server generate`` (``omni_server.cli``), ``create_app`` for
embedding the HTTP API, ``ServerConfig`` / ``build_config`` for the configuration model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_server.config import DEFAULT_MODEL, ConfigError, ServerConfig, build_config, load_config_file

__version__ = "0.12.0"

if TYPE_CHECKING:
    from omni_server.api import create_app


def __getattr__(name: str) -> Any:
    # FastAPI is imported only by code that serves, so the CLI's argument errors stay fast.
    if name == "create_app":
        from omni_server.api import create_app

        return create_app
    raise AttributeError(f"module 'omni_server' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL",
    "ConfigError",
    "ServerConfig",
    "build_config",
    "create_app",
    "load_config_file",
    "__version__",
]
