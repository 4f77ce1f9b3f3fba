"""Scheduler -> Worker allocation snapshots.

These are trusted internal payloads (like vLLM's ``SchedulerOutput`` DTOs): the
manager builds them from allocator results, and the Worker's install path owns
geometry and block-table validation. They compare by value, so a test (or a
Worker deciding whether a resumed request changed) can use ``==``.

``block_ids`` holds one list of physical block ids per KV-cache group, in
logical order: ``block_ids[g][i]`` backs tokens ``[i * block_size, (i + 1) *
block_size)`` of the row in group ``g``. The lists are the allocator's own
values copied at reservation time; treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiffusionKVSequenceMetadata:
    """One primary (CFG) row of a public request.

    Invariants: ``prefix_len + target_len <= seq_len``; the row owns enough
    blocks in every group for ``seq_len`` tokens; ``context_ids`` names
    request-scoped contexts (in the sequence's declared order) whose rows are
    described once, at request scope, in ``DiffusionKVMetadata.contexts``.
    ``num_computed_tokens`` is the cached-prefix length shared by every CFG row
    of the request (0 while prefix caching is off).
    """

    sequence_id: int
    prefix_len: int
    target_len: int
    seq_len: int
    block_ids: tuple[list[int], ...]
    context_ids: tuple[str, ...] = ()
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class DiffusionKVContextMetadata:
    """One request-scoped context row (for example cross-attention text K/V).

    A context shared by several sequences appears here exactly once and owns
    one row; it is never on the primary token axis and never prefix-cached.
    """

    context_id: str
    cache_role: str
    num_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True)
class DiffusionKVMetadata:
    """Complete, atomic allocation snapshot of one public request.

    ``request_id`` is the public id. ``allocation_generation`` is
    manager-global and strictly increasing: a request id that is freed and
    reserved again gets a higher generation, so Worker cleanup addressed to an
    old generation can never remove the new rows. ``sequences`` are ordered by
    ``sequence_id`` (0..N-1).
    """

    request_id: str
    allocation_generation: int
    sequences: tuple[DiffusionKVSequenceMetadata, ...]
    contexts: tuple[DiffusionKVContextMetadata, ...] = ()

    @property
    def num_rows(self) -> int:
        """Worker rows this request occupies while installed (sequences + contexts)."""
        return len(self.sequences) + len(self.contexts)


__all__ = [
    "DiffusionKVContextMetadata",
    "DiffusionKVMetadata",
    "DiffusionKVSequenceMetadata",
]
