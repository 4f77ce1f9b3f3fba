"""Rectified flow: x_t = (1 - t) x0 + t noise, the model predicts v = noise - x0; Euler from t = 1 to t = 0."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_training_times(batch: int, generator: torch.Generator, device: torch.device | str) -> Tensor:
    """Logit-normal t (mean 0, std 1): more weight on the middle of the path, where the task is hardest."""
    return torch.sigmoid(torch.randn(batch, generator=generator, device=device))


def noisy_sample(x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """(x_t, target velocity) for clean images x0 [B, ...], noise like x0, times t [B]."""
    t_ = t.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t_) * x0 + t_ * noise, noise - x0


def euler_times(num_steps: int, device: torch.device | str = "cpu") -> Tensor:
    """The sampler's time grid, float32 [num_steps + 1], from 1 down to 0 inclusive."""
    return torch.linspace(1.0, 0.0, num_steps + 1, device=device)


def guided_velocity(cond: Tensor, uncond: Tensor | None, guidance_scale: float) -> Tensor:
    """Classifier-free guidance: uncond + g (cond - uncond); with g == 1 (or no uncond row) just cond."""
    if uncond is None or guidance_scale == 1.0:
        return cond
    return uncond + guidance_scale * (cond - uncond)


def euler_step(x: Tensor, velocity: Tensor, t: float | Tensor, t_next: float | Tensor) -> Tensor:
    return x + (t_next - t) * velocity


def initial_noise(seed: int, shape: tuple[int, ...]) -> Tensor:
    """The starting noise for a seed, drawn on the CPU in float32 so every device starts from the same tensor."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)
