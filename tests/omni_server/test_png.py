"""omni_server.png: the threaded PNG encoder, checked by decoding its files with Pillow and zlib."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from omni_server.png import encode_png, filtered_scanlines


def _decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The PNG's (type, payload) chunks, each CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, payload = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + payload)
        out.append((kind, payload))
        at += 12 + length
    return out


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
@pytest.mark.parametrize("size", [(1, 1), (5, 3), (7, 1024), (640, 480)])
def test_pixels_round_trip_through_pillow(mode, size):
    rng = np.random.default_rng(sum(size))
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
    back = _decoded(encode_png(image))
    assert back.mode == mode and back.size == image.size
    assert np.array_equal(np.asarray(back), np.asarray(image))


def test_a_large_image_is_deflated_in_chunks_that_form_one_stream():
    """1024x1024 RGB is 3 MiB of scanlines: 4 threads cut it into 4 deflate streams joined by sync flushes. The
    one IDAT inflates to the Up-filtered scanlines, with the zlib header and Adler-32 of one stream."""
    y, x = np.mgrid[0:1024, 0:1024]
    pixels = np.stack([x % 256, y % 256, (x * y) % 251], axis=-1).astype(np.uint8)
    image = Image.fromarray(pixels)
    threaded, single = encode_png(image, threads=4), encode_png(image, threads=1)
    for data in (threaded, single):
        assert np.array_equal(np.asarray(_decoded(data)), pixels)
    chunks = _chunks(threaded)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert zlib.decompress(chunks[1][1]) == filtered_scanlines(pixels).tobytes()
    assert threaded != single  # the sync flushes are in the threaded stream only


def test_filtered_scanlines_are_png_up_filter():
    pixels = np.array([[[10, 200, 255]], [[5, 201, 0]]], dtype=np.uint8)  # 2 rows of one RGB pixel
    lines = filtered_scanlines(pixels)
    assert lines.tolist() == [[2, 10, 200, 255], [2, 251, 1, 1]]  # (5-10), (201-200), (0-255) mod 256


def test_smooth_images_compress_like_pillows_at_the_same_level():
    """The Up filter on a smooth image: within 10% of Pillow's adaptive filters' size at level 1."""
    y, x = np.mgrid[0:512, 0:512]
    pixels = np.stack([x // 2, y // 2, (x + y) // 4], axis=-1).astype(np.uint8)
    image = Image.fromarray(pixels)
    pillow = io.BytesIO()
    image.save(pillow, format="PNG", compress_level=1)
    assert len(encode_png(image)) <= 1.1 * len(pillow.getvalue())


def test_other_modes_go_through_pillow():
    image = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).convert("P")
    back = _decoded(encode_png(image))
    assert np.array_equal(np.asarray(back.convert("RGB")), np.asarray(image.convert("RGB")))


@pytest.mark.parametrize(("kwargs", "message"), [({"level": 10}, "level"), ({"threads": 0}, "threads")])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        encode_png(Image.new("RGB", (2, 2)), **kwargs)
