"""Input images for the edits tests (``conftest.py`` puts this folder on ``sys.path``; pytest runs with
``--import-mode=importlib``)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(image: Image.Image, **save) -> bytes:
    """``image`` encoded as a file (PNG unless ``format=`` says otherwise; other keywords go to ``Image.save``)."""
    buffer = io.BytesIO()
    image.save(buffer, format=save.pop("format", "PNG"), **save)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int) -> Image.Image:
    """A ``width`` x ``height`` RGB image of uniform random pixels."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
