"""The procedural shapes world: palette, geometry, renderer, the scene list and its held-out split.

Images are 32x32 RGB. One shape of a fixed size (a 9x9 footprint) is drawn in a palette colour at one of nine
grid positions (cell centres 6, 16, 26 on each axis, jittered by up to one pixel) on a background of another
palette colour. Rendering is exact (no anti-aliasing), vectorised in torch, and runs on any device, so training
draws fresh batches on the GPU.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import torch

from omni_models.training.captions import COLOR_NAMES, POSITION_NAMES, SHAPE_NAMES, SceneSpec

IMAGE_SIZE = 32
CELL_CENTERS: tuple[int, ...] = (6, 16, 26)
MAX_JITTER = 1
SHAPE_RADIUS = 4  # every shape fits in the 9x9 square centred on its centre pixel

# Well separated in RGB (min pairwise distance > 100), so a slightly off colour still maps back correctly.
PALETTE_RGB: tuple[tuple[int, int, int], ...] = (
    (220, 40, 40),  # red
    (250, 140, 30),  # orange
    (240, 220, 40),  # yellow
    (40, 180, 60),  # green
    (40, 80, 220),  # blue
    (150, 60, 200),  # purple
    (240, 240, 240),  # white
    (20, 20, 20),  # black
)
assert len(PALETTE_RGB) == len(COLOR_NAMES)

NUM_HELD_OUT = 200


def shape_masks(dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Membership of integer offsets (dx, dy) from a shape centre, for every shape: bool [num_shapes, *dx.shape].

    Order follows SHAPE_NAMES: circle (inscribed in the square), square (9x9), triangle (apex up, base 9 wide),
    diamond (|dx| + |dy| <= 4).
    """
    r = SHAPE_RADIUS
    inside_box = (dx.abs() <= r) & (dy.abs() <= r)
    circle = dx * dx + dy * dy <= r * r + r // 2
    square = inside_box
    triangle = inside_box & (2 * dx.abs() <= dy + r)
    diamond = dx.abs() + dy.abs() <= r
    return torch.stack([circle, square, triangle, diamond])


def shape_templates(device: torch.device | str = "cpu") -> torch.Tensor:
    """The footprint of every shape as float [num_shapes, 9, 9] (1 inside), centred on the middle pixel."""
    offsets = torch.arange(-SHAPE_RADIUS, SHAPE_RADIUS + 1, device=device)
    dy, dx = torch.meshgrid(offsets, offsets, indexing="ij")
    return shape_masks(dx, dy).float()


def render(
    shape: torch.Tensor,
    color: torch.Tensor,
    position: torch.Tensor,
    background: torch.Tensor,
    jitter: torch.Tensor | None = None,
) -> torch.Tensor:
    """Render a batch of scenes as float [B, 3, 32, 32] in [-1, 1].

    All index tensors are int64 [B] on one device; ``jitter`` is int64 [B, 2] (dx, dy) in [-1, 1] or None.
    """
    device = shape.device
    palette = torch.tensor(PALETTE_RGB, dtype=torch.float32, device=device) / 127.5 - 1.0
    centers = torch.tensor(CELL_CENTERS, device=device)
    cx = centers[position % 3]
    cy = centers[position // 3]
    if jitter is not None:
        cx = cx + jitter[:, 0]
        cy = cy + jitter[:, 1]
    coords = torch.arange(IMAGE_SIZE, device=device)
    dx = coords.view(1, 1, -1) - cx.view(-1, 1, 1)
    dy = coords.view(1, -1, 1) - cy.view(-1, 1, 1)
    masks = shape_masks(dx, dy)  # [S, B, H, W]
    mask = masks.gather(0, shape.view(1, -1, 1, 1).expand(1, -1, IMAGE_SIZE, IMAGE_SIZE))[0]
    fg = palette[color].view(-1, 3, 1, 1)
    bg = palette[background].view(-1, 3, 1, 1)
    return torch.where(mask.unsqueeze(1), fg, bg)


def all_scenes() -> list[SceneSpec]:
    """Every scene of the world (4 shapes x 8 colours x 9 positions x 7 backgrounds = 2016), in a fixed order."""
    return [
        SceneSpec(shape, color, position, background)
        for shape, color, position, background in itertools.product(
            range(len(SHAPE_NAMES)), range(len(COLOR_NAMES)), range(len(POSITION_NAMES)), range(len(COLOR_NAMES))
        )
        if color != background
    ]


def _scene_hash(scene: SceneSpec) -> str:
    key = (
        f"{SHAPE_NAMES[scene.shape]}|{COLOR_NAMES[scene.color]}|{POSITION_NAMES[scene.position]}|"
        f"{COLOR_NAMES[scene.background]}"
    )
    return hashlib.sha256(key.encode()).hexdigest()


def split_scenes(num_held_out: int = NUM_HELD_OUT) -> tuple[list[SceneSpec], list[SceneSpec]]:
    """(train, held_out): the held-out scenes are the ``num_held_out`` with the smallest SHA-256 of their names.

    Deterministic across machines and versions of Python and torch; the model never sees a held-out combination
    of attributes (in any caption form) during training.
    """
    ranked = sorted(all_scenes(), key=_scene_hash)
    held_out = ranked[:num_held_out]
    held_keys = set(held_out)
    return [s for s in all_scenes() if s not in held_keys], held_out


def scenes_to_tensor(scenes: Sequence[SceneSpec], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [N, 4] of (shape, color, position, background)."""
    return torch.tensor([[s.shape, s.color, s.position, s.background] for s in scenes], device=device)
