"""PNG encoding on several threads: a request waits for its image's PNG, and one zlib stream is one core's work.

The file is an ordinary PNG (any decoder reads it):
- each scanline is filtered with PNG's ``Up`` filter (the byte minus the byte above it, mod 256), computed in one
  numpy pass;
- the filtered bytes are cut into chunks of whole scanlines, and each chunk is deflated on its own thread. zlib
  releases the GIL while it compresses. Every chunk but the last ends with a sync flush, so the raw deflate
  streams concatenate into one valid stream (pigz's method);
- that stream is wrapped in the zlib header and the Adler-32 of all the filtered bytes, and goes in one ``IDAT``.

Pillow's encoder is the reference: ``tests/omni_server/test_png.py`` decodes both and compares the pixels.
``benchmarks/png_encode.py`` times both.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import struct
import threading
import zlib

import numpy as np
from PIL import Image

from omni_server.cpu_budget import usable_cpus

# Channels of the modes written directly; any other mode goes through Pillow.
_COLOUR_TYPES = {"L": (0, 1), "RGB": (2, 3), "RGBA": (6, 4)}
_UP = 2  # PNG filter type "Up"
_MIN_CHUNK_BYTES = 256 * 1024  # below this a chunk's thread costs more than it saves
_MAX_THREADS = 8

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@functools.cache
def default_threads() -> int:
    """The CPUs this process may use (affinity mask and cgroup quota: ``omni_server.cpu_budget``), at most 8."""
    return min(_MAX_THREADS, usable_cpus().count)


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(default_threads(), thread_name_prefix="png-deflate")
        return _pool


def _chunk(buffer: memoryview, level: int, last: bool) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: the header and checksum come once
    return compressor.compress(buffer) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def filtered_scanlines(pixels: np.ndarray) -> np.ndarray:
    """``pixels`` ``[H, W, C]`` uint8 as PNG's filtered scanlines ``[H, 1 + W * C]``: each row starts with the
    filter byte (``Up``) and holds its bytes minus the row above's, mod 256 (the first row as it is)."""
    rows = pixels.reshape(pixels.shape[0], -1)
    out = np.empty((rows.shape[0], rows.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = _UP
    out[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=out[1:, 1:])  # uint8 arithmetic wraps: mod 256
    return out


def encode_png(image: Image.Image, *, level: int = 1, threads: int | None = None) -> bytes:
    """``image`` as PNG bytes, deflated at zlib ``level`` on up to ``threads`` threads (default:
    ``default_threads()``; chunks are at least 256 KiB). Modes other than L, RGB and RGBA go through
    Pillow at the same level."""
    if not 0 <= level <= 9:
        raise ValueError(f"level must be in [0, 9], got {level}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if image.mode not in _COLOUR_TYPES:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=level)
        return buffer.getvalue()
    colour_type, channels = _COLOUR_TYPES[image.mode]
    pixels = np.asarray(image, dtype=np.uint8).reshape(image.height, image.width, channels)
    lines = filtered_scanlines(pixels)
    data = memoryview(lines.reshape(-1))
    count = max(1, min(threads or default_threads(), len(data) // _MIN_CHUNK_BYTES, lines.shape[0]))
    bounds = [lines.shape[1] * (lines.shape[0] * i // count) for i in range(count + 1)]
    pieces = [data[bounds[i] : bounds[i + 1]] for i in range(count)]
    if count == 1:
        deflated = [_chunk(pieces[0], level, last=True)]
    else:
        futures = [_executor().submit(_chunk, piece, level, i == count - 1) for i, piece in enumerate(pieces)]
        deflated = [future.result() for future in futures]
    stream = b"\x78\x01" + b"".join(deflated) + struct.pack(">I", zlib.adler32(data))
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", stream) + _png_chunk(b"IEND", b"")


__all__ = ["default_threads", "encode_png", "filtered_scanlines"]
