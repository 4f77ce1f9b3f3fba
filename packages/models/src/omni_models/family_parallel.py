"""One request of a diffusers family on several ranks: CFG-parallel rows (FLUX.1, Qwen-Image, Wan) and Ulysses
sequence parallelism (FLUX.1).

Same contract as ``omni_models.parallel`` (the CFG and SP groups of ``init_parallel``'s device mesh; every rank
runs the same ``FamilyPipeline`` calls, each computes its share and every rank ends each forward with every row's
velocity, so every rank advances every job alike and any rank decodes):

- CFG-parallel: the rows of one transformer forward (cond and uncond rows of true-CFG jobs, single rows of the
  others) are cut into ``cfg`` contiguous shares of near-equal count (rows of one forward have the same size, so
  equal counts are equal work); a true-CFG job's cond and uncond rows are adjacent, so with one such job they
  land on different ranks. A lone unguided row runs on CFG rank 0 while rank 1 waits at the all-gather.
- Ulysses SP (FLUX.1 and Wan): each rank runs the transformer on its share of the tokens; the attention processor
  all-to-alls ``[B, S / sp, H, D]`` into ``[B, S, H / sp, D]`` around the (self-)attention and back. Both attend
  over every token without a mask, so the gathered order of the tokens does not matter.
  - FLUX.1: each rank feeds the transformer its slice of the text tokens and of the image tokens (and of their
    position ids, so FLUX's rotary embedding is computed per local token). Text and image lengths must divide by
    ``sp`` (a padded token would be attended to).
  - Wan: each rank feeds it a band of the latent's rows (``H / sp`` latent rows, whole patches: the patch rows
    must divide by ``sp``); the rotary tables are the whole video's, cut to the band's tokens (a hook on the
    denoiser's ``rope``), TI2V's per-token timesteps likewise; the cross-attention reads the whole text locally;
    the bands are gathered back along the height.
  - Qwen-Image rows carry ragged text, which this split does not handle yet: SP is refused for it.
- Step caches (``forward_with_cache``): each rank runs its rows' caches; every rank takes every job's decision from
  the change summed over all ranks (one all-reduce per decision boundary), so the ranks agree on each decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from diffusion_kv import cdiv
from omni_models.family_attention import OmniFluxAttnProcessor, OmniWanAttnProcessor
from omni_models.parallel import ParallelState, check_sequence_parallel
from omni_models.registry import AttentionDtype

if TYPE_CHECKING:
    from omni_models.families import DenoiseRow, FamilyPipeline

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _tokens_to_heads(query: Tensor, key: Tensor, value: Tensor, state: ParallelState) -> tuple[Tensor, ...]:
    """q, k, v ``[B, S / sp, H, D]`` -> ``[B, S, H / sp, D]`` (every rank's tokens, in rank order, for this rank's
    heads), one all-to-all for the three."""
    sp = state.sp_size
    batch, tokens, heads, size = query.shape
    stacked = torch.stack((query, key, value))  # [3, B, S / sp, H, D]
    send = stacked.reshape(3, batch, tokens, sp, heads // sp, size).permute(3, 0, 1, 2, 4, 5).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=state.sp_group)  # received[i]: rank i's tokens, my heads
    return tuple(received.permute(1, 2, 0, 3, 4, 5).reshape(3, batch, sp * tokens, heads // sp, size).unbind(0))


def _heads_to_tokens(x: Tensor, state: ParallelState) -> Tensor:
    """Inverse of ``_tokens_to_heads``."""
    sp = state.sp_size
    batch, total, heads, size = x.shape
    send = x.reshape(batch, sp, total // sp, heads, size).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=state.sp_group)  # received[j]: my tokens, head group j
    return received.permute(1, 2, 0, 3, 4).reshape(batch, total // sp, sp * heads, size)


class UlyssesWanAttnProcessor(OmniWanAttnProcessor):
    """``OmniWanAttnProcessor`` whose self-attention runs over every rank's tokens for this rank's head group (its
    cross-attention reads the whole text on every rank, so it needs no exchange)."""

    def __init__(self, state: ParallelState, attention_dtype: AttentionDtype = "auto") -> None:
        super().__init__(attention_dtype)
        self.state = state

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return _heads_to_tokens(super().attend(*_tokens_to_heads(query, key, value, self.state)), self.state)


class UlyssesFluxAttnProcessor(OmniFluxAttnProcessor):
    """``OmniFluxAttnProcessor`` whose attention runs over every rank's tokens for this rank's head group."""

    def __init__(self, state: ParallelState, attention_dtype: AttentionDtype = "auto") -> None:
        super().__init__(attention_dtype)
        self.state = state

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return _heads_to_tokens(super().attend(*_tokens_to_heads(query, key, value, self.state)), self.state)


def _slice(x: Tensor, dim: int, state: ParallelState) -> Tensor:
    return x.chunk(state.sp_size, dim=dim)[state.sp_rank]


class ParallelFamilyBackend:
    """A family backend whose ``forward`` runs this rank's share; everything else is the wrapped backend's."""

    def __init__(self, backend: Any, state: ParallelState) -> None:
        self.inner = backend
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, rows: Sequence[DenoiseRow], *shape: Any) -> Tensor:
        return self.forward_with_cache(rows, *shape, None)

    def forward_with_cache(self, rows: Sequence[DenoiseRow], *shape_and_plan: Any) -> Tensor:
        """``forward`` with the rows' step caches (``plan``): this rank runs its rows' cache, and every rank takes
        every job's decisions from the changes summed over all ranks (a cond row on one CFG rank and its uncond row
        on the other decide together; SP ranks add their token slices' shares). ``shape_and_plan``: the wrapped
        backend's shape arguments (``height, width``; Wan's ``expert``), then the plan."""
        *shape, plan = shape_and_plan
        state = self.state
        per_rank = cdiv(len(rows), state.cfg_size)
        indices = range(state.cfg_rank * per_rank, min((state.cfg_rank + 1) * per_rank, len(rows)))
        mine = [rows[i] for i in indices]
        reduce = None
        if plan is not None:
            from omni_models.step_cache_blocks import all_reduce_sum

            reduce = all_reduce_sum()
        if mine:
            with plan.forward(indices, reduce) if plan is not None else contextlib.nullcontext():
                local = self._forward_sp(mine, *shape) if state.sp_size > 1 else self.inner.forward(mine, *shape)
        else:
            if plan is not None:
                plan.idle(reduce, self.inner.device)
            local = None
        if state.cfg_size == 1:
            return local
        shape = rows[0].latents.shape
        padded = torch.zeros((per_rank, *shape), dtype=self.inner.dtype, device=self.inner.device)
        if local is not None:
            padded[: local.shape[0]] = local
        out = padded.new_empty((per_rank * state.cfg_size, *shape))
        _all_gather(out, padded, group=state.cfg_group)
        return out[: len(rows)]

    def _forward_sp(self, rows: Sequence[DenoiseRow], *shape: Any) -> Tensor:
        if self.inner.family.name == "wan":
            return self._forward_wan_sp(rows, *shape)
        return self._forward_flux_sp(rows, *shape)

    def _forward_wan_sp(self, rows: Sequence[DenoiseRow], expert: int) -> Tensor:
        """Wan under Ulysses SP: this rank's band of latent rows through the denoiser, the bands gathered."""
        inner, state = self.inner, self.state
        sp, rank = state.sp_size, state.sp_rank
        denoiser = inner.denoisers[expert]
        latents = torch.stack([row.latents for row in rows]).to(inner.dtype)  # [B, C, T, H, W]
        p_t, p_h, p_w = denoiser.config.patch_size
        frames, rows_h, cols = latents.shape[2] // p_t, latents.shape[3] // p_h, latents.shape[4] // p_w
        if rows_h % sp:
            raise ValueError(
                f"a sequence-parallel size of {sp} does not divide the {rows_h} patch rows of this video "
                f"({rows_h * p_h * inner.vae_scale_factor} pixels high); choose a height (or size) they divide into"
            )
        band = rows_h // sp
        timestep = torch.stack([row.timestep for row in rows])
        if inner.expand_timesteps:  # one timestep per latent token: this band's
            timestep = timestep.to(torch.float32)[:, None].expand(-1, frames * band * cols)

        def whole_video(_module: nn.Module, _args: tuple) -> tuple:
            return (latents,)

        def band_of(_module: nn.Module, _args: tuple, tables: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
            return tuple(
                t.unflatten(1, (frames, rows_h, cols))[:, :, rank * band : (rank + 1) * band].flatten(1, 3)
                for t in tables
            )

        hooks = [
            denoiser.rope.register_forward_pre_hook(whole_video),
            denoiser.rope.register_forward_hook(band_of),
        ]
        try:
            local = denoiser(
                hidden_states=latents.chunk(sp, dim=3)[rank].contiguous(),
                timestep=timestep,
                encoder_hidden_states=torch.stack([row.text.tokens for row in rows]),
                return_dict=False,
            )[0]
        finally:
            for hook in hooks:
                hook.remove()
        gathered = local.new_empty((sp * local.shape[0], *local.shape[1:]))
        _all_gather(gathered, local.contiguous(), group=state.sp_group)  # rank-major: [sp * B, C, T, H / sp, W]
        return gathered.unflatten(0, (sp, -1)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)

    def _forward_flux_sp(self, rows: Sequence[DenoiseRow], height: int, width: int) -> Tensor:
        inner, state = self.inner, self.state
        text = torch.stack([row.text.tokens for row in rows])
        latents = torch.stack([row.latents for row in rows])
        for name, length in (("text", text.shape[1]), ("image", latents.shape[1])):
            if length % state.sp_size:
                raise ValueError(
                    f"a sequence-parallel size of {state.sp_size} does not divide the {length} {name} tokens "
                    "of this forward; choose a size (or max_sequence_length) they divide into"
                )
        guidance = None
        if inner.transformer.config.guidance_embeds:
            guidance = torch.tensor([row.guidance for row in rows], dtype=torch.float32, device=inner.device)
        txt_ids = torch.zeros(text.shape[1], 3, device=inner.device, dtype=inner.dtype)
        local = inner.transformer(
            hidden_states=_slice(latents, 1, state),
            timestep=inner.timesteps(rows),
            guidance=guidance,
            pooled_projections=torch.stack([row.text.pooled for row in rows]),
            encoder_hidden_states=_slice(text, 1, state),
            txt_ids=_slice(txt_ids, 0, state),
            img_ids=_slice(inner.image_ids(height, width), 0, state),
            return_dict=False,
        )[0]
        gathered = local.new_empty((state.sp_size * local.shape[0], *local.shape[1:]))
        _all_gather(gathered, local.contiguous(), group=state.sp_group)  # rank-major: [sp * B, S / sp, C]
        return gathered.unflatten(0, (state.sp_size, -1)).transpose(0, 1).flatten(1, 2)


def enable_family_parallel(pipe: FamilyPipeline, state: ParallelState) -> None:
    """Run ``pipe``'s transformer forwards as this rank's share (CFG rows; Ulysses SP for FLUX.1 and Wan)."""
    if isinstance(pipe.backend, ParallelFamilyBackend):
        raise RuntimeError("this pipeline already runs in parallel")
    if state.sp_size > 1:
        if not pipe.backend.family.sequence_parallel:
            raise ValueError(
                f"sequence parallelism applies to FLUX.1 and Wan among the families; the Ulysses split does not "
                f"handle {pipe.info.family} rows yet (use CFG-parallelism)"
            )
        check_sequence_parallel(pipe.transformer.config.num_attention_heads, state.sp_size)
        attention_dtype = next(iter(pipe.transformer.attn_processors.values())).attention_dtype
        if pipe.info.family == "wan":
            for denoiser in pipe.backend.denoisers:  # both experts of Wan2.2 A14B
                for block in denoiser.blocks:
                    block.attn1.set_processor(UlyssesWanAttnProcessor(state, attention_dtype))
        else:
            pipe.transformer.set_attn_processor(UlyssesFluxAttnProcessor(state, attention_dtype))
    pipe.backend = ParallelFamilyBackend(pipe.backend, state)
    # The budget is one rank's: a forward's rows (CFG) and tokens (SP) are shared out over the ranks.
    pipe.max_batched_image_tokens *= state.cfg_size * state.sp_size
