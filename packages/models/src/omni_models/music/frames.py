"""Per-request frame state of the AR stage: the frame buffer, window planning, eviction and flush.

Windows are ``window`` frames long and start every ``hop`` frames (Music 3: 200 and 100; omni-tones-tiny: 32
and 16). A non-final window is released only once a frame past its end exists (so it is provably not the last);
after it is taken, frames before ``start + hop`` are evicted. The final window (flushed when the song ends)
spans from the next unreleased window start to the last frame, so it holds at most ``window + hop`` frames.
Invariants: the union of released spans is every frame exactly once (taking each span's part after the
previous span's end); the buffer never holds more than ``window + hop`` frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from omni_models.music.config import NUM_CODEBOOKS


@dataclass(frozen=True)
class Window:
    """Frames ``[start, end)`` of a song (absolute indices)."""

    start: int
    end: int
    is_first: bool = False
    is_last: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


def chunk_windows(frames: int, window: int = 200, hop: int = 100) -> list[Window]:
    """Windows covering ``frames``: starts ``0, hop, 2 hop, ...``, each ``window`` long (the last cut at the end);
    stops after the first window that reaches the end. Only the first is ``is_first``, only the last ``is_last``."""
    if frames <= 0:
        return []
    if frames <= window:
        return [Window(0, frames, True, True)]
    out: list[Window] = []
    start = 0
    while True:
        end = min(start + window, frames)
        out.append(Window(start, end, start == 0, end == frames))
        if end == frames:
            return out
        start += hop


def crop_sample_bounds(w: Window, blend_frames: int, hop_frames: int, samples_per_frame: int) -> tuple[int, int]:
    """Samples to trim from a decoded window: ``(left, right)``; nothing on the song's outer edges."""
    left = 0 if w.is_first else blend_frames * samples_per_frame
    right = 0 if w.is_last else (hop_frames - blend_frames) * samples_per_frame
    return left, right


class FrameBuffer:
    """Frames ``[base_frame, end_frame)`` of one song, each ``[1, width]``; older frames are discarded."""

    def __init__(self) -> None:
        self._frames: list[Tensor] = []
        self.base_frame = 0
        self.peak_frames = 0

    @property
    def end_frame(self) -> int:
        return self.base_frame + len(self._frames)

    def append(self, frame: Tensor) -> None:
        if frame.dim() != 2 or frame.shape[0] != 1:
            raise ValueError(f"a frame is [1, width], got {tuple(frame.shape)}")
        self._frames.append(frame)
        self.peak_frames = max(self.peak_frames, len(self._frames))

    def slice(self, start: int, end: int) -> Tensor:
        if start < self.base_frame or end > self.end_frame or start >= end:
            raise RuntimeError(
                f"frames [{start}, {end}) are unavailable: the buffer holds [{self.base_frame}, {self.end_frame})"
            )
        return torch.cat(self._frames[start - self.base_frame : end - self.base_frame])

    def discard_before(self, frame: int) -> None:
        frame = min(max(frame, self.base_frame), self.end_frame)
        del self._frames[: frame - self.base_frame]
        self.base_frame = frame


@dataclass
class RequestARState:
    """One song's AR state, keyed by pair id: its seed, frame cap, frames and windows released so far."""

    seed: int
    max_frames: int
    prompt_tokens: int = 0
    window: int = 200
    hop: int = 100
    frames: FrameBuffer = field(default_factory=FrameBuffer)
    emitted_windows: int = 0
    draws: int = 0
    finished: bool = False

    def advance_position(self) -> int:
        """The draw slot of the next frame: ``0, 8, 16, ...`` (one slot per codebook, unique per song)."""
        position = self.draws * NUM_CODEBOOKS
        self.draws += 1
        return position

    def ready_window(self) -> Window | None:
        """The next non-final window, once a frame past its end exists."""
        start = self.emitted_windows * self.hop
        if self.frames.end_frame > start + self.window:
            return Window(start, start + self.window, is_first=start == 0)
        return None

    def final_window(self) -> Window | None:
        """The span still to flush when the song ends (None if nothing is left)."""
        start = self.emitted_windows * self.hop
        end = self.frames.end_frame
        if end <= start:
            return None
        return Window(start, end, is_first=start == 0, is_last=True)

    def take_window(self, w: Window, is_final: bool) -> Tensor:
        """The window's frames; a non-final take evicts frames before ``start + hop``."""
        frames = self.frames.slice(w.start, w.end)
        self.emitted_windows += 1
        if not is_final:
            self.frames.discard_before(w.start + self.hop)
        return frames

    def take_codes(self, start: int, end: int) -> Tensor | None:
        """Codes ``[end - start, 8]`` of live frames (the first 8 columns), or None when out of range."""
        try:
            return self.frames.slice(start, end)[:, :NUM_CODEBOOKS]
        except RuntimeError:
            return None
