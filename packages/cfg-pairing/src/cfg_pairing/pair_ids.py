"""Which requests take part in CFG pairing, and which pair each one belongs to.

A request opts in through ``request.sampling_params.extra_args["cfg_role"]``
(``"cond"`` or ``"uncond"``). Its pair id is ``extra_args["cfg_pair_id"]`` when
that is present and truthy; otherwise it is derived from the user-facing
request id: a cond member's id is the pair id, an uncond member's id has the
longest registered companion suffix stripped (``"req-1__cfg_uncond"`` ->
``"req-1"``).

Invariant: the suffix registry never contains an empty string, so stripping a
suffix always shortens the id and two different ids of one role never collapse
onto each other by accident.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Final

logger = logging.getLogger("cfg_pairing")

COND_ROLE: Final = "cond"
UNCOND_ROLE: Final = "uncond"
CFG_ROLES: Final = frozenset({COND_ROLE, UNCOND_ROLE})

DEFAULT_UNCOND_SUFFIX: Final = "__cfg_uncond"

# Mutable on purpose: models register their companion suffix at import time,
# and tests snapshot/restore it. Read it through `cfg_uncond_suffixes()`.
_UNCOND_REQUEST_ID_SUFFIXES: set[str] = {DEFAULT_UNCOND_SUFFIX}


def register_cfg_uncond_suffix(suffix: str) -> None:
    """Register a request-id suffix that marks an uncond companion.

    Raises ``ValueError`` (and registers nothing) unless ``suffix`` is a
    non-empty ``str``.
    """
    if not isinstance(suffix, str) or not suffix:
        raise ValueError(
            f"CFG uncond request-id suffix must be a non-empty string, got {suffix!r}; "
            "pass the exact text your model appends to the cond request id, e.g. '__cfg_uncond'"
        )
    _UNCOND_REQUEST_ID_SUFFIXES.add(suffix)


def cfg_uncond_suffixes() -> frozenset[str]:
    """Snapshot of the registered companion suffixes (always has ``"__cfg_uncond"`` by default)."""
    return frozenset(_UNCOND_REQUEST_ID_SUFFIXES)


def cfg_extra_args(request: Any) -> dict[str, Any] | None:
    """The request's ``sampling_params.extra_args`` dict, or ``None`` when it has none."""
    sampling_params = getattr(request, "sampling_params", None)
    extra_args = getattr(sampling_params, "extra_args", None)
    return extra_args if isinstance(extra_args, dict) else None


def cfg_role_of(request: Any) -> str | None:
    """``"cond"`` / ``"uncond"`` for a pairing request, ``None`` for plain traffic.

    An unknown role value is logged and treated as plain traffic: raising here
    would fail inside the engine's ``add_request``, far from whoever sent it.
    """
    extra_args = cfg_extra_args(request)
    if not extra_args or "cfg_role" not in extra_args:
        return None
    role = extra_args["cfg_role"]
    if role not in CFG_ROLES:
        logger.warning(
            "request %r has cfg_role=%r; expected one of %s, so it runs unguided",
            getattr(request, "request_id", "?"),
            role,
            sorted(CFG_ROLES),
        )
        return None
    return role


def strip_uncond_suffix(request_id: str) -> str:
    """``request_id`` without the longest registered companion suffix it ends with."""
    longest = max(
        (suffix for suffix in _UNCOND_REQUEST_ID_SUFFIXES if request_id.endswith(suffix)),
        key=len,
        default="",
    )
    return request_id[: len(request_id) - len(longest)] if longest else request_id


def pair_id_for(request: Any, role: str) -> Hashable:
    """The pair id of a request whose role is ``role`` (see the module docstring).

    The user-facing id (``external_req_id``) wins over ``request_id`` because
    engines may rename requests to unique internal ids that lose the suffix.
    """
    extra_args = cfg_extra_args(request) or {}
    explicit = extra_args.get("cfg_pair_id")
    if explicit:
        return explicit
    user_facing_id = getattr(request, "external_req_id", None) or request.request_id
    return strip_uncond_suffix(user_facing_id) if role == UNCOND_ROLE else user_facing_id
