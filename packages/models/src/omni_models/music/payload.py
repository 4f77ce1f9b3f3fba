"""The AR stage's per-step payload to the acoustic stage: list-valued, one entry per batch row.

A batched payload is split per request by row index; a scalar would be handed to every request, crossing seeds,
windows and terminal flags between songs. So every member is a list with one entry per row, and rows without a
span carry an empty latent and ``None`` metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Span:
    """Frames ``[start, start + len(codes))`` of a song, released by the AR stage."""

    start: int
    codes: Tensor  # [T, 8] int64
    latent: Tensor  # [T, hidden]
    last_chunk: bool
    audio_seed: int


def make_payload(infos: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One payload for a batch from per-row info dicts, consuming (popping) each row's ``span``.

    Returns None when no row has a span. Otherwise ``latent: list[Tensor]``, ``codes: {"audio": list[Tensor]}``
    and ``meta: {key: list}``, one entry per row.
    """
    spans: list[Span | None] = [info.pop("span", None) for info in infos]
    if all(span is None for span in spans):
        return None
    latents, codes = [], []
    meta: dict[str, list[Any]] = {
        "num_processed_tokens": [],
        "codec_chunk_frames": [],
        "last_chunk": [],
        "audio_seed": [],
    }
    for span in spans:
        if span is None:
            latents.append(torch.empty(0))
            codes.append(torch.empty(0, 8, dtype=torch.long))
            for key in meta:
                meta[key].append(None)
            continue
        latents.append(span.latent)
        codes.append(span.codes)
        meta["num_processed_tokens"].append(span.start)
        meta["codec_chunk_frames"].append(int(span.codes.shape[0]))
        meta["last_chunk"].append(span.last_chunk)
        meta["audio_seed"].append(span.audio_seed)
    return {"latent": latents, "codes": {"audio": codes}, "meta": meta}


def payload_element(value: Any, row: int) -> Any:
    """Row ``row``'s part of a payload member: lists are indexed by row, anything else is shared."""
    if isinstance(value, dict):
        return {key: payload_element(v, row) for key, v in value.items()}
    if isinstance(value, list):
        return value[row]
    return value
