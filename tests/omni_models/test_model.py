"""The causal-prefix invariants that make prefix K/V reuse exact, on a random-weight model."""

from __future__ import annotations

import torch

from omni_models.model import causal_prefix_mask
from omni_models.tokenizer import PAD_ID


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.tensor([[1, 2, 7, 15, 3, 4], [1, 2, 9, 16, PAD_ID, PAD_ID]])
    images = torch.randn(2, 3, 32, 32, generator=generator)
    return token_ids, images, torch.tensor([0.25, 0.9])


def test_prefix_cache_path_equals_joint_forward(random_model):
    token_ids, images, t = _inputs()
    with torch.no_grad():
        joint = random_model(token_ids, images, t)
        split = random_model.forward_target(images, t, random_model.encode_prefix(token_ids))
    assert joint.abs().mean() > 0.05  # a real signal, not an all-zero output
    torch.testing.assert_close(split, joint, rtol=1e-5, atol=1e-5)


def test_prefix_kv_depend_only_on_the_prompt_and_causally(random_model):
    token_ids, _, _ = _inputs()
    with torch.no_grad():
        full = random_model.encode_prefix(token_ids[:1])
        truncated = random_model.encode_prefix(token_ids[:1, :3])
    for layer in range(random_model.config.depth):
        # Text token i never sees later tokens: the first 3 positions match a 3-token prompt exactly.
        torch.testing.assert_close(full.keys[layer][:, :3], truncated.keys[layer], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(full.values[layer][:, :3], truncated.values[layer], rtol=1e-6, atol=1e-6)


def test_image_tokens_see_the_prompt_and_padding_is_inert(random_model):
    token_ids, images, t = _inputs()
    with torch.no_grad():
        padded = random_model(token_ids[1:], images[1:], t[1:])
        unpadded = random_model(token_ids[1:, :4], images[1:], t[1:])
        other_prompt = random_model(token_ids[:1], images[1:], t[1:])
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
    assert (padded - other_prompt).abs().max() > 1e-3


def test_causal_prefix_mask_layout():
    mask = causal_prefix_mask(torch.tensor([[True, True, False]]), num_target=2)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # text 0 sees itself
            [1, 1, 0, 0, 0],  # text 1 causal
            [1, 1, 0, 0, 0],  # padding query: valid text only (never empty)
            [1, 1, 0, 1, 1],  # image queries: all valid text + all image
            [1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
