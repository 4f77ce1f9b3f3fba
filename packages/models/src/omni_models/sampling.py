"""Dense-path generation: encode each prompt's prefix once, then Euler steps over the target only.

This is the reference sampler (no paged cache) used by training-time evaluation and by the pipeline's dense
attention backend. Row layout per step: the conditional rows of every image, then (with guidance) the
unconditional rows, all in one forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from omni_models.flow import euler_step, euler_times, guided_velocity, initial_noise
from omni_models.model import CausalPrefixDiT
from omni_models.tokenizer import PAD_ID


def pad_token_ids(token_ids: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    """Right-pad prompts with PAD into int64 [B, max_len]."""
    length = max(len(ids) for ids in token_ids)
    padded = torch.full((len(token_ids), length), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return padded.to(device)


@torch.no_grad()
def generate_dense(
    model: CausalPrefixDiT,
    cond_ids: Sequence[Sequence[int]],
    uncond_ids: Sequence[Sequence[int]] | None,
    seeds: Sequence[int],
    *,
    num_steps: int,
    guidance_scale: float,
    height: int,
    width: int,
    autocast_dtype: torch.dtype | None = None,
) -> Tensor:
    """Images float32 [B, C, H, W] in model space (about [-1, 1]) for B prompts.

    ``uncond_ids`` (the negative/null prompt per image) is used only when ``guidance_scale != 1``.
    ``autocast_dtype`` (e.g. bfloat16 on CUDA) runs the forward passes under autocast; the state x stays float32.
    """
    device = next(model.parameters()).device
    channels = model.config.in_channels
    x = torch.stack([initial_noise(seed, (channels, height, width)) for seed in seeds]).to(device)
    guided = guidance_scale != 1.0 and uncond_ids is not None
    rows = list(cond_ids) + (list(uncond_ids) if guided else [])
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    # Without autocast the model runs in its own dtype (e.g. bfloat16 weights on CUDA); x stays float32.
    input_dtype = next(model.parameters()).dtype if autocast_dtype is None else torch.float32
    times = euler_times(num_steps, device)
    with autocast:
        prefix_kv = model.encode_prefix(pad_token_ids(rows, device))
        for step in range(num_steps):
            t = times[step].expand(len(rows))
            model_in = (torch.cat([x, x]) if guided else x).to(input_dtype)
            velocity = model.forward_target(model_in, t, prefix_kv).float()
            cond, uncond = velocity.chunk(2) if guided else (velocity, None)
            x = euler_step(x, guided_velocity(cond, uncond, guidance_scale), times[step], times[step + 1])
    return x
