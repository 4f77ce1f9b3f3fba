"""The one error type a caller of a pipeline has to handle for bad requests."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is invalid; nothing was changed.

    ``param`` names the offending field ("prompt", "size", "num_inference_steps", "guidance_scale", "model",
    ...) so a server can turn it into a 400 response that points at the field.
    """

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param
