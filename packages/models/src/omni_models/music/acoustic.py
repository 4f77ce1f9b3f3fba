"""The acoustic stage: a flow-matching transformer that turns a window of frame codes into per-frame synthesis
latents, window by window, carrying the previous window forward.

The network is omni's causal-prefix DiT (``omni_models.model.CausalPrefixDiT``): the window's codes are the
causal prefix (one token per frame and codebook, after BOS), the window's latents the target (one token per
frame: a ``[channels, 1, window]`` "image" in patches of 1). The codes never see the timestep, so their K/V are
computed once per window and reused by every Euler step: through ``diffusion_kv``'s paged cache (the omni
pipeline's stepwise API) or dense (``encode_prefix``/``forward_target``). Carrying: frames a window shares with
the previous one are known; at every Euler step they are set to the known latents noised to the step's time
(inpainting), so the new frames continue the old ones. The same model takes omni's FP8 linears
(``integrations.quantize_fp8``) and layerwise offload plan (``integrations.offload_plan``) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from omni_models.config import DiTConfig
from omni_models.flow import euler_step, euler_times
from omni_models.model import CausalPrefixDiT
from omni_models.music.config import NUM_CODEBOOKS, MusicConfig
from omni_models.music.frames import chunk_windows
from omni_models.tokenizer import BOS_ID

_CODE_STRIDE = 37  # ids per codebook in the prefix vocabulary (>= every codebook's size)


def acoustic_config(config: MusicConfig) -> DiTConfig:
    if max(config.c0_vocab_size, config.codebook_size) > _CODE_STRIDE:
        raise ValueError(f"codebooks larger than {_CODE_STRIDE} codes need a wider prefix vocabulary")
    return DiTConfig(
        name=f"{config.name}-acoustic",
        width=config.acoustic_width,
        depth=config.acoustic_depth,
        num_heads=config.acoustic_heads,
        patch_size=1,
        vocab_size=2 + NUM_CODEBOOKS * _CODE_STRIDE,
        max_prompt_tokens=1 + NUM_CODEBOOKS * config.window_frames,
        in_channels=config.latent_channels,
        supported_sizes=((1, config.window_frames),),
        default_steps=config.acoustic_steps,
        default_guidance=config.acoustic_guidance,
    )


def acoustic_prefix_ids(codes: Tensor, config: MusicConfig) -> Tensor:
    """Prefix token ids [1 + 8 W] for a window's codes [W, 8] (padded to ``window_frames`` with its last frame)."""
    w = config.window_frames
    if codes.shape[0] < w:
        codes = torch.cat([codes, codes[-1:].expand(w - codes.shape[0], -1)])
    offsets = 2 + _CODE_STRIDE * torch.arange(NUM_CODEBOOKS)
    return torch.cat([torch.tensor([BOS_ID]), (codes.long() + offsets).flatten()])


def window_noise(seed: int, index: int, config: MusicConfig) -> Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn((config.latent_channels, 1, config.window_frames), generator=generator)


VelocityFn = Callable[[Tensor, float], Tensor]  # (x [C, 1, W], t) -> velocity


def denoise_window(velocity: VelocityFn, noise: Tensor, times: list[float], known: Tensor | None) -> Tensor:
    """Euler from ``noise`` [C, 1, W]; ``known`` [C, 1, K] pins the first K frames (inpainting)."""
    x = noise.clone()
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        if known is not None:
            x[..., : known.shape[-1]] = (1 - t) * known + t * noise[..., : known.shape[-1]]
        x = euler_step(x, velocity(x, t), t, t_next)
    if known is not None:
        x[..., : known.shape[-1]] = known
    return x


@torch.no_grad()
def generate_latents(
    dit: CausalPrefixDiT,
    config: MusicConfig,
    codes: Tensor,
    *,
    seed: int,
    device: str | torch.device,
    steps: int | None = None,
    windows_velocity: Callable[[Tensor], VelocityFn] | None = None,
) -> Tensor:
    """Latents [T, channels] (float32, CPU) for a song's codes [T, 8].

    ``windows_velocity(prefix_ids) -> velocity`` supplies the per-window velocity function (default: the dense
    path, prefix K/V encoded once per window and reused by every step).
    """
    total = codes.shape[0]
    out = torch.zeros(total, config.latent_channels)
    times = euler_times(steps or config.acoustic_steps).tolist()
    dtype = next(dit.parameters()).dtype
    done = 0
    for index, w in enumerate(chunk_windows(total, config.window_frames, config.hop_frames)):
        ids = acoustic_prefix_ids(codes[w.start : w.end].cpu(), config).to(device)
        velocity = windows_velocity(ids) if windows_velocity is not None else _dense_velocity(dit, ids, dtype)
        known_frames = done - w.start
        known = out[w.start : done].T[:, None, :].to(device) if known_frames > 0 else None
        x = denoise_window(velocity, window_noise(seed, index, config).to(device), times, known)
        out[done : w.end] = x[:, 0, known_frames if known_frames > 0 else 0 : w.length].T.float().cpu()
        done = w.end
    return out


def _dense_velocity(dit: CausalPrefixDiT, ids: Tensor, dtype: torch.dtype) -> VelocityFn:
    prefix = dit.encode_prefix(ids[None])

    def velocity(x: Tensor, t: float) -> Tensor:
        tt = torch.full((1,), t, device=x.device, dtype=torch.float32)
        return dit.forward_target(x[None].to(dtype), tt, prefix)[0].float()

    return velocity


class PagedAcoustic:
    """The acoustic transformer run through omni's paged pipeline: each window's code K/V are written once into
    ``diffusion_kv`` blocks and read through block tables by every Euler step."""

    def __init__(
        self,
        dit: CausalPrefixDiT,
        config: MusicConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
    ) -> None:
        from omni_models.pipeline import Pipeline
        from omni_models.tokenizer import BOS_TOKEN, PAD_TOKEN, Tokenizer

        self.config = config
        self.block_size = block_size
        self.pipeline = Pipeline(
            dit, Tokenizer([PAD_TOKEN, BOS_TOKEN]), device=torch.device(device), dtype=dtype, attention_backend="paged"
        )

    def denoise(self, ids: Tensor, noise: Tensor, times: list[float], known: Tensor | None) -> Tensor:
        """Like `denoise_window`, through the paged cache (one private pool per window)."""
        from omni_models.request import ResolvedRequest
        from omni_models.runner import GenerationJob, GenerationRow

        w = self.config.window_frames
        request = ResolvedRequest(
            prompt="",
            negative_prompt=None,
            n=1,
            height=1,
            width=w,
            num_inference_steps=len(times) - 1,
            guidance_scale=1.0,
            true_cfg_scale=None,
            seed=0,
        )
        job = GenerationJob(
            request=request,
            rows=(GenerationRow("cond", tuple(ids.tolist()), w),),
            latents=noise.clone().to(self.pipeline.device),
            times=tuple(times),
        )
        self.pipeline.allocate_kv_caches_for([job], self.block_size)
        self.pipeline.start([job])
        for t in times[:-1]:
            if known is not None:
                k = known.shape[-1]
                job.latents[..., :k] = (1 - t) * known + t * noise[..., :k].to(job.latents.device)
            self.pipeline.step([job])
        if known is not None:
            job.latents[..., : known.shape[-1]] = known
        return job.latents


@torch.no_grad()
def generate_latents_paged(paged: PagedAcoustic, codes: Tensor, *, seed: int, steps: int | None = None) -> Tensor:
    """`generate_latents` through `PagedAcoustic` (the serving path)."""
    config = paged.config
    total = codes.shape[0]
    out = torch.zeros(total, config.latent_channels)
    times = euler_times(steps or config.acoustic_steps).tolist()
    device = paged.pipeline.device
    done = 0
    for index, w in enumerate(chunk_windows(total, config.window_frames, config.hop_frames)):
        ids = acoustic_prefix_ids(codes[w.start : w.end].cpu(), config)
        known_frames = done - w.start
        known = out[w.start : done].T[:, None, :].to(device) if known_frames > 0 else None
        x = paged.denoise(ids, window_noise(seed, index, config), times, known)
        out[done : w.end] = x[:, 0, max(known_frames, 0) : w.length].T.float().cpu()
        done = w.end
    return out
