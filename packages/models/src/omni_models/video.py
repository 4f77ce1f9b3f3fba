"""``Video``: what a video pipeline's ``decode`` returns for one job (numpy only, no torch, no encoder).

The frames are 8-bit RGB, ``(T, H, W, 3)``; ``fps`` is the request's frame rate. Writing a container (MP4) is the
caller's business (the server's); the pixels are the model's own, rounded from its ``[0, 1]`` output as diffusers'
``numpy_to_pil`` rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Video:
    """One generated clip. Invariant: ``frames`` is C-contiguous ``uint8`` of shape ``(num_frames, height, width, 3)``
    and ``fps >= 1``."""

    frames: np.ndarray
    fps: int

    def __post_init__(self) -> None:
        frames = self.frames
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise ValueError(f"frames must be a uint8 array of shape (T, H, W, 3), got {_describe(frames)}")
        if not frames.flags.c_contiguous:
            object.__setattr__(self, "frames", np.ascontiguousarray(frames))
        if isinstance(self.fps, bool) or not isinstance(self.fps, int) or self.fps < 1:
            raise ValueError(f"fps must be a positive integer, got {self.fps!r}")

    @classmethod
    def from_float(cls, frames: np.ndarray, fps: int) -> Video:
        """From ``(T, H, W, 3)`` floats in [0, 1] (diffusers' ``output_type="np"``), rounded to 8 bits."""
        return cls((np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8), fps)

    @property
    def num_frames(self) -> int:
        return self.frames.shape[0]

    @property
    def height(self) -> int:
        return self.frames.shape[1]

    @property
    def width(self) -> int:
        return self.frames.shape[2]

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {value.shape}"
    return type(value).__name__


__all__ = ["Video"]
