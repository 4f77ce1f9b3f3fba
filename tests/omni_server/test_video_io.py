"""MP4 through PyAV (``omni_server.video_io``): the file is decoded again by FFmpeg and compared with its frames.

Two comparisons, each against a reference that does not go through the encoder: the decoded ``yuv420p`` planes vs
the frames converted to ``yuv420p`` by the same swscale call (what the encoder is handed: the codec's loss alone),
and the decoded RGB vs the frames themselves for smooth colour (which 4:2:0 sampling keeps: the whole loss,
conversions included). Pixel noise in RGB cannot survive 4:2:0 (its colour changes within 2x2 pixels), so it is
compared in yuv420p only.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

video_io = pytest.importorskip("omni_server.video_io")
pytest.importorskip("av")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def noise(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def smooth(frames: int, height: int, width: int, period: float = 64.0) -> np.ndarray:
    """Moving colour waves of ``period`` pixels, each channel its own (chroma that 4:2:0 sampling keeps)."""
    y, x = np.mgrid[0:height, 0:width] * (2 * np.pi / period)
    waves = [
        np.stack([np.sin(x + t / 1.4), np.cos(y - t / 2.0), np.sin((x + y) / 1.5 + t / 1.1)], axis=-1)
        for t in range(frames)
    ]
    return (128 + 100 * np.stack(waves)).round().astype(np.uint8)


def test_mp4_is_h264_yuv420p_with_every_frame_at_the_size_and_rate() -> None:
    frames = noise(9, 32, 48)
    data = video_io.encode_mp4(frames, 16)
    assert data[4:8] == b"ftyp" and 0 < data.find(b"moov") < data.find(b"mdat")  # faststart: the index first
    decoded = video_io.decode_mp4(data)
    assert (decoded.codec, decoded.pix_fmt, decoded.width, decoded.height) == ("h264", "yuv420p", 48, 32)
    assert decoded.fps == Fraction(16) and decoded.frames.shape == (9, 32, 48, 3)
    assert video_io.encode_mp4(frames, 16) == data  # the same frames, the same bytes
    assert video_io.decode_mp4(video_io.encode_mp4(frames[:1], 24)).frames.shape == (1, 32, 48, 3)


def test_mp4_pixels_match_the_frames_at_high_quality() -> None:
    frames = noise(9, 32, 48, seed=1)  # the hardest content for a codec
    reference = video_io.yuv420p(frames)
    figures = {}
    for crf in (0, 10, 18):
        decoded = video_io.decode_mp4(video_io.encode_mp4(frames, 16, crf=crf), pixel_format="yuv420p")
        assert decoded.frames.shape == reference.shape == (9, 48, 48)
        figures[crf] = psnr(decoded.frames, reference)
    print(f"noise, decoded yuv420p vs the frames' yuv420p: {figures} dB by crf")
    assert figures[0] == math.inf  # lossless
    assert figures[10] >= 40.0 and figures[18] < figures[10]
    waves = smooth(9, 64, 64)
    whole = {crf: psnr(video_io.decode_mp4(video_io.encode_mp4(waves, 16, crf=crf)).frames, waves) for crf in (0, 10)}
    print(f"smooth colour, decoded RGB vs the frames: {whole} dB by crf")
    assert whole[0] >= 48.0 and whole[10] >= 42.0


@pytest.mark.parametrize(
    ("frames", "fps", "crf", "words"),
    [
        (np.zeros((2, 32, 32, 3), np.float32), 16, 18, "uint8 RGB"),
        (np.zeros((2, 32, 32), np.uint8), 16, 18, "uint8 RGB"),
        (np.zeros((0, 32, 32, 3), np.uint8), 16, 18, "T >= 1"),
        (np.zeros((2, 33, 32, 3), np.uint8), 16, 18, "even width and height"),
        (np.zeros((2, 32, 32, 3), np.uint8), 0, 18, "fps"),
        (np.zeros((2, 32, 32, 3), np.uint8), 16, 52, "crf"),
        (np.zeros((2, 32, 32, 3), np.uint8), 16, True, "crf"),
    ],
)
def test_bad_frames_and_settings_are_refused_by_name(frames, fps, crf, words) -> None:
    with pytest.raises(video_io.VideoEncodingError, match=words):
        video_io.encode_mp4(frames, fps, crf=crf)
