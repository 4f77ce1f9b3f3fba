"""The in-process parity check of issue 28 (FamilyPipeline.__call__(image=...) vs diffusers' FluxKontextPipeline).

Run: python benchmarks/results/2026-12-02/edits/parity_inprocess.py (writes /tmp/k28/ckpt).
"""

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from omni_models import load, synthetic


def psnr(a, b) -> float:
    x, y = np.asarray(a, float), np.asarray(b, float)
    mse = ((x - y) ** 2).mean()
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


components = synthetic.flux_components("tiny", guidance_embeds=True)
directory = synthetic.save_checkpoint("flux-kontext", components, Path("/tmp/k28/ckpt"))
pipe = load(str(directory))
reference = synthetic.diffusers_pipeline("flux-kontext", components)
image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
common = dict(num_inference_steps=3, guidance_scale=2.5, height=32, width=32, num_images_per_prompt=2)
for extra in ({}, {"negative_prompt": "blurry", "true_cfg_scale": 2.0}):
    ours = pipe("a red circle", image=image, seed=7, **common, **extra)
    generators = [torch.Generator("cpu").manual_seed(7 + i) for i in range(2)]
    theirs = reference(
        image=image,
        prompt="a red circle",
        generator=generators,
        max_area=32 * 32,
        _auto_resize=False,
        **common,
        **extra,
    ).images
    print(extra, [psnr(a, b) for a, b in zip(ours, theirs, strict=True)])
