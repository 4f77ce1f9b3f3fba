"""omni's dense attention entry point for the diffusers families: one function, the fastest correct backend.

Layout ``[batch, seq, heads, head_dim]`` (what the families' projections produce). Every row attends over all
of its keys (non-causal), except that a batch may be *ragged at its end*: with ``RowLengths(lengths)`` row ``r``
uses only its first ``lengths[r]`` positions, as queries and as keys; its later positions are padding, never
attended to, and their outputs are zeros. That lets requests whose prompts have different lengths share one
forward without changing any real token's result (a joint text+image layer puts the text last for this, so
that each row's padding is a tail).

Backends, tried in order (the first whose ``supports`` accepts the call runs it):
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` without a mask, so on CUDA torch's dispatcher
  can pick cuDNN (the fastest on H100/H200 at DiT shapes); a ragged batch runs one unmasked call per group of
  rows with equal length, on views of the rows' leading positions (no copy of Q, K or V when a group's rows
  are adjacent), rather than one masked call (a mask would rule cuDNN and flash out).
A faster omni kernel slots in by adding an ``AttentionBackend`` ahead of it in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RowLengths:
    """Row ``r`` of a padded batch uses only its first ``lengths[r]`` positions (queries and keys)."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or not all(isinstance(n, int) and n > 0 for n in self.lengths):
            raise ValueError(f"row lengths {self.lengths} must be positive ints, one per row")

    def uniform(self, padded_len: int) -> bool:
        return all(n == padded_len for n in self.lengths)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports: Callable[[Tensor, RowLengths | None], bool]
    run: Callable[[Tensor, Tensor, Tensor, RowLengths | None], Tensor]


def _sdpa(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Unmasked SDPA over ``[B, S, H, D]`` tensors, in the same transposed layout diffusers' native backend uses."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out.transpose(1, 2)


def _row_groups(lengths: tuple[int, ...]) -> list[tuple[int, slice | list[int]]]:
    """``(length, rows)`` per distinct length; ``rows`` is a slice when the group's rows are adjacent."""
    groups = []
    for length in sorted(set(lengths)):
        members = [r for r, n in enumerate(lengths) if n == length]
        adjacent = members == list(range(members[0], members[-1] + 1))
        groups.append((length, slice(members[0], members[-1] + 1) if adjacent else members))
    return groups


def _sdpa_rows(query: Tensor, key: Tensor, value: Tensor, lengths: RowLengths | None) -> Tensor:
    padded_len = query.shape[1]
    if lengths is None or lengths.uniform(padded_len):
        return _sdpa(query, key, value)
    if len(lengths.lengths) != query.shape[0]:
        raise ValueError(f"RowLengths has {len(lengths.lengths)} lengths for a batch of {query.shape[0]} rows")
    if max(lengths.lengths) > padded_len:
        raise ValueError(f"row lengths {lengths.lengths} exceed the padded length {padded_len}")
    out = torch.empty_like(query)
    for row, length in enumerate(lengths.lengths):
        out[row, length:] = 0
    for length, rows in _row_groups(lengths.lengths):
        out[rows, :length] = _sdpa(*(x[rows, :length] for x in (query, key, value)))
    return out


BACKENDS: list[AttentionBackend] = [
    AttentionBackend("sdpa", supports=lambda query, lengths: True, run=_sdpa_rows),
]


def select_backend(query: Tensor, lengths: RowLengths | None = None) -> AttentionBackend:
    for backend in BACKENDS:
        if backend.supports(query, lengths):
            return backend
    raise RuntimeError(f"no attention backend supports {query.dtype} {tuple(query.shape)} on {query.device}")


def attention(query: Tensor, key: Tensor, value: Tensor, lengths: RowLengths | None = None) -> Tensor:
    """Non-causal attention over ``[B, S, H, D]`` tensors (optionally ragged: each row's first ``lengths[r]``)."""
    if not query.shape == key.shape == value.shape:
        raise ValueError(f"query, key and value shapes differ: {query.shape}, {key.shape}, {value.shape}")
    return select_backend(query, lengths).run(query, key, value, lengths)


def row_lengths(lengths: Sequence[int], padded_len: int) -> RowLengths | None:
    """None when every row uses all ``padded_len`` positions (the plain, fastest path)."""
    lengths = tuple(int(n) for n in lengths)
    return None if all(n == padded_len for n in lengths) else RowLengths(lengths)
