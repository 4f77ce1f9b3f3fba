"""Guided sampling of one frame for a CFG pair: c0 from the backbone logits, then codebooks 1..7 from the
depth decoder, both blended ``uncond + scale (cond - uncond)`` and masked to the conditioned branch's top-k.

c0 is drawn only among ``[<|audio_end|>, c0 codes...]``; every draw uses a generator seeded by the song's seed
and the draw slot (``RequestARState.advance_position``), so a song does not depend on what else is batched with
it. Both rows are fed the same codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from omni_models.music.backbone import DepthDecoder
from omni_models.music.config import AUDIO_END, NUM_CODEBOOKS, MusicConfig

_SEED_MIX = 0x9E3779B97F4A7C15


def slot_generator(seed: int, slot: int) -> torch.Generator:
    """A CPU generator for draw ``slot`` of the song seeded ``seed`` (independent streams per slot)."""
    return torch.Generator().manual_seed((seed * _SEED_MIX + slot * 0x2545F491 + 1) % (2**63 - 1))


def guided_draw(cond: Tensor, uncond: Tensor | None, scale: float, top_k: int, generator: torch.Generator) -> int:
    """Index drawn from ``softmax(uncond + scale (cond - uncond))`` restricted to ``cond``'s top-k entries."""
    cond = cond.float()
    blended = cond if uncond is None or scale == 1.0 else uncond.float() + scale * (cond - uncond.float())
    k = min(top_k, cond.numel())
    keep = torch.topk(cond, k).indices
    probs = torch.softmax(blended[keep], dim=-1).cpu()
    return int(keep[torch.multinomial(probs, 1, generator=generator)].item())


def c0_candidates(config: MusicConfig, device: torch.device | str) -> Tensor:
    """Vocabulary ids the c0 draw may pick: ``<|audio_end|>`` then every c0 code."""
    codes = torch.arange(config.audio_code_offset, config.audio_code_offset + config.c0_vocab_size, device=device)
    return torch.cat([torch.tensor([AUDIO_END], device=device), codes])


def sample_frames(
    config: MusicConfig,
    depth: DepthDecoder,
    cond_logits: Tensor,
    uncond_logits: Tensor | None,
    cond_hidden: Tensor,
    uncond_hidden: Tensor | None,
    seeds: list[int],
    slots: list[int],
    scale: float,
    top_k: int,
) -> list[tuple[int, list[int] | None]]:
    """One guided frame for each of N pairs: ``(token_id, codes)`` per pair.

    ``cond_logits``/``uncond_logits`` are [N, vocab] backbone logits, ``*_hidden`` [N, hidden] the states they
    came from. ``codes`` is the frame's 8 code indices, or None when the song ends (``token_id`` is then
    ``<|audio_end|>``). Draw ``k`` of a frame uses ``slot_generator(seed, slot + k)``.
    """
    n = cond_logits.shape[0]
    candidates = c0_candidates(config, cond_logits.device)
    cond_c0 = cond_logits[:, candidates].float().cpu()
    uncond_c0 = None if uncond_logits is None else uncond_logits[:, candidates].float().cpu()
    results: list[tuple[int, list[int] | None]] = []
    for i in range(n):
        choice = guided_draw(
            cond_c0[i], None if uncond_c0 is None else uncond_c0[i], scale, top_k, slot_generator(seeds[i], slots[i])
        )
        token = int(candidates[choice].item())
        results.append((token, None if token == AUDIO_END else [token - config.audio_code_offset]))
    live = [i for i, (_, codes) in enumerate(results) if codes is not None]
    if not live:
        return results
    index = torch.tensor(live, device=cond_hidden.device)
    hidden = cond_hidden[index]
    if uncond_hidden is not None:
        hidden = torch.cat([hidden, uncond_hidden[index]])
    m = len(live)
    c0 = torch.tensor([results[i][1][0] for i in live], device=hidden.device).repeat(hidden.shape[0] // m)
    with torch.no_grad():
        for k in range(1, NUM_CODEBOOKS):
            prev = torch.tensor([results[i][1][1:] for i in live], dtype=torch.long, device=hidden.device)
            prev = prev.view(m, k - 1).repeat(hidden.shape[0] // m, 1)
            logits = depth.logits(hidden.to(depth.proj.weight.dtype), c0, prev)[:, -1].float().cpu()
            for j, i in enumerate(live):
                code = guided_draw(
                    logits[j],
                    logits[m + j] if uncond_hidden is not None else None,
                    scale,
                    top_k,
                    slot_generator(seeds[i], slots[i] + k),
                )
                results[i][1].append(code)
    return results
