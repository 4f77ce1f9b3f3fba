"""omni's torchvision-free Qwen2-VL processor against transformers' torchvision one (2026-12-02, CPU).

Run with PyPI's torchvision 0.28.0 installed outside the test envs (``pip install --no-deps --target DIR
torchvision==0.28.0``, ``PYTHONPATH=DIR``): its compiled ops do not load beside the CPU torch, so the two op schemas
its import registers fake kernels for are defined first; transformers' torchvision backend uses only
``torchvision.transforms.v2.functional`` (torch code). Output: processor_vs_torchvision.log.
"""

import torch

_ops = torch.library.Library("torchvision", "DEF")
_ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor  # noqa: E402
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor  # noqa: E402

from omni_models import synthetic  # noqa: E402
from omni_models.diffusers_adapter import qwen2_vl_processor  # noqa: E402

SIZES = [(384, 384), (96, 96), (40, 24), (16, 32), (100, 60), (333, 500), (28, 28), (56, 56), (1000, 700)]
SIZES += [(13, 300), (32, 32), (1184, 880)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"

tokenizer = synthetic.qwen_image_components("tiny")["tokenizer"]
ours = qwen2_vl_processor(tokenizer)
real = Qwen2VLProcessor(
    image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
)
rng = np.random.default_rng(0)
identical = 0
for w, h in SIZES:
    images = [Image.fromarray(rng.integers(0, 256, shape + (3,), dtype=np.uint8)) for shape in ((h, w), (w, h))]
    text = [f"Picture 1: {PAD}Picture 2: {PAD} a red cat"]
    a = real(text=text, images=images, padding=True, return_tensors="pt")
    b = ours(text=text, images=images, padding=True, return_tensors="pt")
    assert set(a.keys()) == set(b.keys()), (a.keys(), b.keys())
    same = all(torch.equal(a[k], b[k]) for k in a.keys())
    identical += same
    print(w, h, sorted(a.keys()), a["image_grid_thw"].tolist(), "identical" if same else "DIFF")
print(f"{identical}/{len(SIZES)} identical")
