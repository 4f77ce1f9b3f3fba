"""A deterministic prompt-adherence scorer that reads shape, colours and position back from pixels.

Reading, per image (uint8 RGB [32, 32, 3]):
1. background colour: per-channel median of the one-pixel border -> nearest palette colour;
2. shape mask: pixels farther than ``MASK_DISTANCE`` (RGB units) from that measured border colour;
3. shape colour: per-channel median of the mask pixels -> nearest palette colour;
4. shape and position: the shape template (exact 9x9 footprints of the renderer) and centre pixel that best
   overlap the mask (highest IoU, computed for every centre at once by convolution); position is the 3x3 cell
   holding that centre.
On the renderer's own images every attribute is read correctly (tested); an empty mask reads as "no shape".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from omni_models.training.captions import COLOR_NAMES, SceneSpec
from omni_models.training.shapes import IMAGE_SIZE, PALETTE_RGB, SHAPE_RADIUS, shape_templates

MASK_DISTANCE = 60.0
ATTRIBUTES: tuple[str, ...] = ("shape", "color", "position", "background")


@dataclass(frozen=True)
class SceneReading:
    """What the scorer read from one image; ``shape``/``color``/``position`` are -1 when no shape was found."""

    shape: int
    color: int
    position: int
    background: int

    def matches(self, scene: SceneSpec) -> dict[str, bool]:
        return {name: getattr(self, name) == getattr(scene, name) for name in ATTRIBUTES}

    def describe(self) -> str:
        if self.shape < 0:
            return f"no shape on a {COLOR_NAMES[self.background]} background"
        return SceneSpec(self.shape, self.color, self.position, self.background).caption()


def _nearest_palette(rgb: torch.Tensor) -> torch.Tensor:
    palette = torch.tensor(PALETTE_RGB, dtype=torch.float32)
    return torch.cdist(rgb.float().reshape(-1, 3), palette).argmin(dim=1)


def read_scenes(images: np.ndarray | torch.Tensor | Sequence) -> list[SceneReading]:
    """Read every image of a batch: uint8 [N, 32, 32, 3] (or a sequence of PIL images / arrays of that shape)."""
    if not isinstance(images, (np.ndarray, torch.Tensor)):
        images = np.stack([np.asarray(image, dtype=np.uint8) for image in images])
    pixels = torch.as_tensor(np.asarray(images)).to(torch.float32)
    if pixels.ndim != 4 or pixels.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"expected uint8 images [N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {tuple(pixels.shape)}")
    n = pixels.shape[0]
    border = torch.cat(
        [pixels[:, 0, :], pixels[:, -1, :], pixels[:, 1:-1, 0], pixels[:, 1:-1, -1]], dim=1
    )  # [N, border_pixels, 3]
    border_rgb = border.median(dim=1).values
    background = _nearest_palette(border_rgb)

    mask = (pixels - border_rgb.view(n, 1, 1, 3)).norm(dim=-1) > MASK_DISTANCE  # [N, H, W]
    mask_area = mask.flatten(1).sum(dim=1)

    templates = shape_templates()  # [S, 9, 9]
    template_area = templates.flatten(1).sum(dim=1)  # [S]
    overlap = F.conv2d(mask.float().unsqueeze(1), templates.unsqueeze(1), padding=SHAPE_RADIUS)  # [N, S, H, W]
    iou = overlap / (mask_area.view(n, 1, 1, 1) + template_area.view(1, -1, 1, 1) - overlap).clamp_min(1.0)
    best = iou.flatten(1).argmax(dim=1)
    best_shape = best // (IMAGE_SIZE * IMAGE_SIZE)
    center_y = (best // IMAGE_SIZE) % IMAGE_SIZE
    center_x = best % IMAGE_SIZE
    # Three equal bands per axis: pixels 0-10, 11-21, 22-31.
    position = (center_y * 3 // IMAGE_SIZE) * 3 + center_x * 3 // IMAGE_SIZE

    readings = []
    for i in range(n):
        if mask_area[i] == 0:
            readings.append(SceneReading(-1, -1, -1, int(background[i])))
            continue
        color = int(_nearest_palette(pixels[i][mask[i]].median(dim=0).values)[0])
        readings.append(SceneReading(int(best_shape[i]), color, int(position[i]), int(background[i])))
    return readings


def adherence(readings: Sequence[SceneReading], scenes: Sequence[SceneSpec]) -> dict[str, float]:
    """Fraction correct per attribute, their mean (``"attributes"``) and the all-four-correct rate (``"scene"``)."""
    if len(readings) != len(scenes) or not scenes:
        raise ValueError(f"need as many readings as scenes (>0), got {len(readings)} and {len(scenes)}")
    matches = [reading.matches(scene) for reading, scene in zip(readings, scenes, strict=True)]
    result = {name: sum(m[name] for m in matches) / len(matches) for name in ATTRIBUTES}
    result["attributes"] = sum(result[name] for name in ATTRIBUTES) / len(ATTRIBUTES)
    result["scene"] = sum(all(m.values()) for m in matches) / len(matches)
    return result
