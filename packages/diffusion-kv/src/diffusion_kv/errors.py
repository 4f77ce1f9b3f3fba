"""The three outcomes of a KV reservation, kept apart.

1. A request-caused failure raises ``DiffusionKVAdmissionError``: the request
   can never be admitted as written (too many rows, too long, can never fit
   the empty pool, malformed sequences). The scheduler finishes *that* request
   with its message and keeps serving the queue.
2. Lack of space is not an error: ``reserve_request`` returns ``None`` and the
   caller retries after other requests release blocks.
3. A broken invariant raises ``DiffusionKVInvariantError``: bookkeeping leaked
   (internal ids still allocated), or undoing a partial reservation failed.
   Nothing about the request caused it and the allocator state can no longer
   be trusted, so the scheduler escalates it as engine-fatal.
"""

from __future__ import annotations


class DiffusionKVAdmissionError(ValueError):
    """A request-specific KV admission failure safe to return to the caller."""


class DiffusionKVInvariantError(RuntimeError):
    """Internal KV bookkeeping is inconsistent; the engine must stop serving.

    Deliberately not a ``ValueError``: code that catches ``ValueError`` to
    report bad input must never swallow this as a per-request error.
    """


__all__ = ["DiffusionKVAdmissionError", "DiffusionKVInvariantError"]
