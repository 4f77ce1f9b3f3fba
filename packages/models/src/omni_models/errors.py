"""The error types a caller of omni_models has to handle: bad requests, bad checkpoints, missing extras."""

from __future__ import annotations

from pathlib import Path


class InvalidRequestError(ValueError):
    """A request field is invalid; nothing was changed.

    ``param`` names the offending field ("prompt", "size", "num_inference_steps", "guidance_scale", "model",
    ...) so a server can turn it into a 400 response that points at the field.
    """

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class CheckpointError(ValueError):
    """A checkpoint on disk cannot be loaded; raised before anything is placed on the target device.

    The message is one line: the file (``path``) and what is wrong with it. ``str(error)`` starts with the path.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = " ".join(problem.split())  # one line, whatever the underlying library wrote
        super().__init__(f"{self.path}: {self.problem}")


class MissingDependencyError(ImportError):
    """An optional dependency (an extra of omni-models) is needed for what was asked; the message says what to
    install."""
