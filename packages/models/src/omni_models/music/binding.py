"""Row binding of the AR stage: which request (and pair) a batch row is, and which rows get fed back.

vLLM compacts and reorders its persistent batch on every finish and preemption, so nothing that lives across
steps is keyed by batch row: songs are keyed by pair id (the user-facing request id without the companion
suffix, or an explicit ``cfg_pair_id``), and rows are bound to songs afresh every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CFG_UNCOND_SUFFIX = "__cfg_uncond"


def request_key(value: Any) -> str:
    """A request id from its bare or list-wrapped form (``["req-1"]`` and ``"req-1"`` agree); None/[] -> ``""``."""
    if isinstance(value, (list, tuple)):
        return str(value[0]) if value else ""
    return "" if value is None else str(value)


def pair_id_from_request(request_id: str) -> str:
    """The pair id of a cond or uncond request id (``"req-1__cfg_uncond"`` -> ``"req-1"``; others unchanged)."""
    return request_id[: -len(CFG_UNCOND_SUFFIX)] if request_id.endswith(CFG_UNCOND_SUFFIX) else request_id


def role_from_request(request_id: str) -> str:
    return "uncond" if request_id.endswith(CFG_UNCOND_SUFFIX) else "cond"


def first_int(value: Any, default: int) -> int:
    """A positive int from a bare or 1-element list/tuple value; anything else (None, [], 0, <0, non-int) ->
    ``default``. Never raises."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            return default
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return default
    return value


def feedback_offsets(
    request_ids: Sequence[str],
    scheduled: Sequence[int],
    computed: Sequence[int],
    prompt_tokens: Mapping[str, int],
    has_codes: Mapping[str, bool],
) -> list[int]:
    """Flat token offsets whose input embedding is replaced by the previous frame's composed embedding.

    Offsets are the running sum of ``scheduled``; a row is fed back iff its request has codes, it schedules one
    token and it is past its prompt (``computed >= prompt_tokens``). A prompt token is never overwritten.
    """
    out: list[int] = []
    offset = 0
    for request_id, n, done in zip(request_ids, scheduled, computed):
        if n == 1 and has_codes.get(request_id, False) and done >= prompt_tokens.get(request_id, 1 << 62):
            out.append(offset)
        offset += n
    return out
