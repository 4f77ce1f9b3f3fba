"""omni's dense attention entry point for the diffusers families: one function, the fastest correct backend.

Layout ``[batch, seq, heads, head_dim]`` (what the families' projections produce). Every row attends over all
of its keys (non-causal), except that a joint text+image batch may be *ragged in its text*: with
``RaggedText(padded_len, lengths)`` row ``r``'s keys are its first ``lengths[r]`` text tokens and every image
token (positions ``>= padded_len``); the padded text positions are never attended to, and their outputs are
zeros. That lets requests whose prompts have different lengths share one forward without changing any real
token's result.

Backends, tried in order (the first whose ``supports`` accepts the call runs it):
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` without a mask, so on CUDA torch's dispatcher
  can pick cuDNN (the fastest on H100/H200 at DiT shapes); a ragged batch runs one unmasked call per group of
  rows with equal text length rather than one masked call (a mask would rule cuDNN and flash out).
A faster omni kernel slots in by adding an ``AttentionBackend`` ahead of it in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RaggedText:
    """Rows share a text segment ``[0, padded_len)``; row ``r`` uses only its first ``lengths[r]`` tokens."""

    padded_len: int
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or not all(0 < n <= self.padded_len for n in self.lengths):
            raise ValueError(f"text lengths {self.lengths} must each be in [1, {self.padded_len}]")

    @property
    def uniform(self) -> bool:
        return all(n == self.padded_len for n in self.lengths)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports: Callable[[Tensor, RaggedText | None], bool]
    run: Callable[[Tensor, Tensor, Tensor, RaggedText | None], Tensor]


def _sdpa(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Unmasked SDPA over ``[B, S, H, D]`` tensors, in the same transposed layout diffusers' native backend uses."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out.transpose(1, 2)


def _without_padding(x: Tensor, rows: Tensor | None, length: int, padded_len: int) -> Tensor:
    """The given rows (all if None) with the unused text positions ``[length, padded_len)`` cut out."""
    x = x if rows is None else x[rows]
    return torch.cat([x[:, :length], x[:, padded_len:]], dim=1)


def _sdpa_ragged(query: Tensor, key: Tensor, value: Tensor, ragged: RaggedText | None) -> Tensor:
    if ragged is None or ragged.uniform:
        return _sdpa(query, key, value)
    if len(ragged.lengths) != query.shape[0]:
        raise ValueError(f"RaggedText has {len(ragged.lengths)} lengths for a batch of {query.shape[0]} rows")
    out = torch.zeros_like(query)
    padded = ragged.padded_len
    for length in sorted(set(ragged.lengths)):
        members = [r for r, n in enumerate(ragged.lengths) if n == length]
        rows = None if len(members) == query.shape[0] else torch.tensor(members, device=query.device)
        result = _sdpa(*(_without_padding(x, rows, length, padded) for x in (query, key, value)))
        target = slice(None) if rows is None else rows
        out[target, :length] = result[:, :length]
        out[target, padded:] = result[:, length:]
    return out


BACKENDS: list[AttentionBackend] = [
    AttentionBackend("sdpa", supports=lambda query, ragged: True, run=_sdpa_ragged),
]


def select_backend(query: Tensor, ragged: RaggedText | None = None) -> AttentionBackend:
    for backend in BACKENDS:
        if backend.supports(query, ragged):
            return backend
    raise RuntimeError(f"no attention backend supports {query.dtype} {tuple(query.shape)} on {query.device}")


def attention(query: Tensor, key: Tensor, value: Tensor, ragged: RaggedText | None = None) -> Tensor:
    """Non-causal attention over ``[B, S, H, D]`` tensors (optionally ragged in the leading text segment)."""
    if not query.shape == key.shape == value.shape:
        raise ValueError(f"query, key and value shapes differ: {query.shape}, {key.shape}, {value.shape}")
    return select_backend(query, ragged).run(query, key, value, ragged)


def ragged_text(lengths: Sequence[int], padded_len: int) -> RaggedText | None:
    """None when every row uses the whole text segment (the plain, fastest path)."""
    lengths = tuple(int(n) for n in lengths)
    return None if all(n == padded_len for n in lengths) else RaggedText(padded_len, lengths)
