"""Input images of an edit request: decoded and checked once, carried as 8-bit RGB pixels.

``decode_input_image(data, ...)`` is what the HTTP edits route and ``omni-server generate --image`` call on each
uploaded file. It refuses, with ``InvalidRequestError`` naming the field, a file over ``max_bytes``, one Pillow
cannot read, one over ``max_pixels`` (checked from the header, before the pixels are decoded: no decompression
bomb is ever expanded), an animation, and an image whose alpha channel holds transparent pixels (without
inpainting, transparency has no meaning for the model: flattening it onto a colour would invent content). It
converts what has one faithful RGB reading: grayscale, palette, CMYK (Pillow's conversion), fully opaque alpha
(dropped) and 16-bit grayscale (scaled to 8 bits). The result is an ``InputImage``: a msgspec struct, so it
travels inside the request to the engine process as bytes.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import msgspec

from omni_models.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image


class InputImage(msgspec.Struct, frozen=True, kw_only=True):
    """One input image: ``width`` x ``height`` 8-bit RGB pixels, row-major (``height * width * 3`` bytes)."""

    width: int
    height: int
    pixels: bytes

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1 or len(self.pixels) != self.width * self.height * 3:
            raise ValueError(f"an InputImage of {self.width}x{self.height} holds {self.width * self.height * 3} bytes")

    @classmethod
    def from_pil(cls, image: Image.Image) -> InputImage:
        rgb = image.convert("RGB")
        return cls(width=rgb.width, height=rgb.height, pixels=rgb.tobytes())

    def to_pil(self) -> Image.Image:
        from PIL import Image

        return Image.frombytes("RGB", (self.width, self.height), self.pixels)


# Modes with one faithful RGB reading (Pillow converts them); the alpha modes are checked for transparency first.
_CONVERTIBLE = {"RGB", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "1", "RGBA", "RGBa", "LA", "La", "PA", "RGBX"}
_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N", "I"}


def decode_input_image(data: bytes, *, max_bytes: int, max_pixels: int, param: str = "image") -> InputImage:
    """One uploaded file as an ``InputImage`` (see the module docstring); ``InvalidRequestError(param=param)``."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequestError(f"{param} is an empty file", param=param)
    if len(data) > max_bytes:
        raise InvalidRequestError(
            f"{param} has {len(data)} bytes; at most {max_bytes} are accepted (--max-input-image-bytes)", param=param
        )
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"{param} is not an image file Pillow can read ({exc})", param=param) from None
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidRequestError(
            f"{param} is {width}x{height} = {width * height} pixels; at most {max_pixels} are accepted "
            "(--max-input-image-pixels)",
            param=param,
        )
    if getattr(image, "n_frames", 1) > 1:
        raise InvalidRequestError(
            f"{param} is an animation ({image.n_frames} frames); send one still image", param=param
        )
    try:
        image.load()
    except Exception as exc:  # a truncated or corrupt file fails only when its pixels are decoded
        raise InvalidRequestError(f"{param} is a corrupt {image.format} file ({exc})", param=param) from None
    return InputImage.from_pil(_to_rgb(image, param))


def _to_rgb(image: Image.Image, param: str) -> Image.Image:
    import numpy as np
    from PIL import Image

    mode = image.mode
    if mode in _SIXTEEN_BIT:
        array = np.asarray(image, dtype=np.int64)
        top = 65535 if mode.startswith("I;16") or array.max(initial=0) > 255 else 255
        if array.min(initial=0) < 0 or array.max(initial=0) > 65535:
            raise InvalidRequestError(
                f"{param} is a 32-bit integer image with values outside [0, 65535]; send 8- or 16-bit pixels",
                param=param,
            )
        return Image.fromarray((array * 255 / top).round().astype(np.uint8), "L").convert("RGB")
    if mode not in _CONVERTIBLE:
        raise InvalidRequestError(
            f"{param} has pixel mode {mode!r}, which has no faithful 8-bit RGB reading; send an RGB, grayscale, "
            "palette, CMYK or 16-bit grayscale image",
            param=param,
        )
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if "A" in image.mode or image.mode in ("RGBa", "La"):
        alpha = image.getchannel("A")
        low, _ = alpha.getextrema()
        if low < 255:
            raise InvalidRequestError(
                f"{param} has transparent pixels (alpha down to {low}); this model does no inpainting, so an alpha "
                "channel has no meaning for it: send the image flattened onto the background you want",
                param=param,
            )
    return image.convert("RGB")


__all__ = ["InputImage", "decode_input_image"]
