"""MP4 files through PyAV (FFmpeg's libx264): the one module of the server that imports ``av``.

``encode_mp4(frames, fps)`` writes H.264 (libx264, ``yuv420p``: what every browser and player decodes) in an MP4
container with its index at the front (``movflags=+faststart``, so a player starts before the whole file has
arrived). ``crf`` is libx264's constant rate factor: 0 is lossless (then the High 4:4:4 Predictive profile,
which browsers do not play), 18 (the default, ``--video-crf``) is visually lossless, 23 is libx264's own default,
51 the worst. Frames are RGB; swscale converts them to BT.601 limited-range YUV, and the stream is tagged so
(``smpte170m``, ``tv`` range, BT.709 primaries and transfer of sRGB content, chroma sited at the centre), so
players convert back the same way.

``yuv420p(frames)`` is that same conversion alone (what the encoder sees), and ``decode_mp4(data)`` reads a file
back (chroma interpolated, as a player shows it); the tests compare an MP4 with the frames it was made from
through them. Both directions use swscale's accurate flags (``_accurate``).

Frame sizes must be even (4:2:0 chroma covers 2x2 pixels); video models' sizes are multiples of 16.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

DEFAULT_CRF = 18
MAX_CRF = 51
MISSING_AV = "MP4 output needs PyAV (the av package, which carries FFmpeg): pip install 'omni-server[video]'"


class VideoEncodingError(ValueError):
    """Frames or settings the encoder cannot take; the message says what to change."""


def _av():
    try:
        import av
    except ImportError:  # pragma: no cover - the video extra installs it
        raise VideoEncodingError(MISSING_AV) from None
    return av


def available() -> bool:
    """Whether PyAV is importable (a server serving a video model checks this at start)."""
    try:
        _av()
    except VideoEncodingError:
        return False
    return True


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise VideoEncodingError(
            f"frames must be uint8 RGB of shape (T, H, W, 3) with T >= 1, got {frames.dtype} {frames.shape}"
        )
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise VideoEncodingError(f"frame size {width}x{height}: H.264 in yuv420p needs an even width and height")
    return np.ascontiguousarray(frames)


def _rate(fps: float | int | Fraction) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001)
    if not 0 < rate <= 240:
        raise VideoEncodingError(f"fps must be in (0, 240], got {fps!r}")
    return rate


def encode_mp4(frames: np.ndarray, fps: float | int | Fraction, *, crf: int = DEFAULT_CRF) -> bytes:
    """``frames`` (uint8, (T, H, W, 3), RGB) as an H.264 ``yuv420p`` MP4 at ``fps`` frames per second."""
    av = _av()
    frames = _check_frames(frames)
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= MAX_CRF:
        raise VideoEncodingError(f"crf must be an integer in [0, {MAX_CRF}], got {crf!r}")
    rate = _rate(fps)
    # faststart rewrites the file to move its index to the front, which needs a file FFmpeg can reopen by name.
    with tempfile.TemporaryDirectory(prefix="omni-mp4-") as directory:
        path = Path(directory) / "video.mp4"
        _write(av, path, frames, rate, crf)
        return path.read_bytes()


def _write(av, path: Path, frames: np.ndarray, rate: Fraction, crf: int) -> None:  # noqa: ANN001 - the av module
    _, height, width, _ = frames.shape
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # swscale samples 4:2:0 chroma at the centre of each 2x2 block; the stream says so (H.264's default is the
        # left edge, and a decoder assuming it shifts colour by half a pixel: 41 dB instead of 50 on smooth colour).
        stream.options = {"crf": str(crf), "preset": "medium", "x264-params": "chromaloc=1"}
        context = stream.codec_context
        context.colorspace, context.color_range = 6, 1  # smpte170m (BT.601, swscale's matrix), limited ("tv")
        context.color_primaries, context.color_trc = 1, 13  # BT.709 primaries, sRGB transfer (IEC 61966-2-1)
        for index, pixels in enumerate(frames):
            frame = _to_yuv420p(av, pixels)
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@dataclass(frozen=True)
class DecodedVideo:
    """A file read back: ``frames`` in the requested pixel format, and the stream's facts."""

    frames: np.ndarray  # rgb24: (T, H, W, 3); yuv420p: (T, H * 3 // 2, W), PyAV's planar layout
    fps: Fraction
    codec: str
    pix_fmt: str
    width: int
    height: int


def decode_mp4(data: bytes, *, pixel_format: str = "rgb24") -> DecodedVideo:
    """Every frame of an MP4 (or any file FFmpeg reads) as ``pixel_format`` (``rgb24`` or ``yuv420p``)."""
    av = _av()
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        context = stream.codec_context
        frames = [
            frame.reformat(format=pixel_format, interpolation=_accurate(av)).to_ndarray()
            for frame in container.decode(stream)
        ]
        return DecodedVideo(
            frames=np.stack(frames),
            fps=Fraction(stream.average_rate),
            codec=context.name,
            pix_fmt=context.pix_fmt,
            width=context.width,
            height=context.height,
        )


def yuv420p(frames: np.ndarray) -> np.ndarray:
    """``frames`` converted as the encoder converts them (swscale, RGB to BT.601 limited-range 4:2:0), in PyAV's
    planar layout (T, H * 3 // 2, W): the reference an encoded file's decoded ``yuv420p`` frames compare with."""
    av = _av()
    frames = _check_frames(frames)
    return np.stack([_to_yuv420p(av, pixels).to_ndarray() for pixels in frames])


def _accurate(av) -> int:  # noqa: ANN001 - the av module
    """swscale's flags for exact conversions: bicubic chroma filtering at full horizontal chroma resolution with
    accurate rounding. Without them its fast path replicates each chroma sample over 2x2 pixels on the way back
    to RGB (about 38 dB on smooth colour, 50 dB with them: ``test_video_io``)."""
    flags = av.video.reformatter.Interpolation
    return int(flags.BICUBIC | flags.FULL_CHR_H_INT | flags.FULL_CHR_H_INP | flags.ACCURATE_RND)


def _to_yuv420p(av, pixels: np.ndarray):  # noqa: ANN001, ANN202 - the av module, an av.VideoFrame
    return av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuv420p", interpolation=_accurate(av))


__all__ = [
    "DEFAULT_CRF",
    "MAX_CRF",
    "DecodedVideo",
    "VideoEncodingError",
    "available",
    "decode_mp4",
    "encode_mp4",
    "yuv420p",
]
