"""Model-space images to pixels."""

from __future__ import annotations

import numpy as np
import torch


def to_uint8_images(images: torch.Tensor) -> np.ndarray:
    """float [N, 3, H, W] in [-1, 1] -> uint8 [N, H, W, 3] (clamped, then rounded to the nearest level)."""
    scaled = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return scaled.permute(0, 2, 3, 1).cpu().numpy()
