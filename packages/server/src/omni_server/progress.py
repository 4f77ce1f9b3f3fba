"""Per-request denoising progress for clients that poll: ``GET /v1/progress/{key}``.

A client that wants progress picks a key (any 8-64 characters of ``[A-Za-z0-9_-]``, e.g. a random UUID) and
sends it as the ``X-Omni-Progress-Key`` header of its ``POST /v1/images/generations``; while the request runs,
``GET /v1/progress/{key}`` answers::

    {"key": "...", "status": "queued" | "running" | "done" | "failed", "step": 3, "total": 28}

``step`` counts the denoising steps every image of the request has completed (``total`` is 0 until the engine
has reported the request once). An unknown key is a 404 (never sent, or forgotten: the board keeps the last
``MAX_TRACKED`` keys). The engine reports progress in ``EngineStats.progress`` after each iteration; nothing
here reaches the engine.

Invariant: the board is bounded (``MAX_TRACKED`` keys) and thread-safe (stats arrive on the client's reader
thread, requests on the event loop).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter
from starlette.exceptions import HTTPException

from omni_server.protocol import EngineStats

PROGRESS_HEADER = "X-Omni-Progress-Key"
MAX_TRACKED = 1024
_KEY = re.compile(r"^[A-Za-z0-9_-]{8,64}$")

Status = Literal["queued", "running", "done", "failed"]


@dataclass
class _Entry:
    request_id: str
    status: Status = "queued"
    step: int = 0
    total: int = 0


class ProgressBoard:
    """Progress of the requests that asked for it, by client key."""

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self._lock = threading.Lock()
        self._max_tracked = max_tracked
        self._by_key: OrderedDict[str, _Entry] = OrderedDict()
        self._by_request: dict[str, _Entry] = {}

    def track(self, key: str | None, request_id: str) -> None:
        """Start tracking ``request_id`` under ``key``; a missing or malformed key tracks nothing."""
        if key is None or not _KEY.match(key):
            return
        with self._lock:
            old = self._by_key.pop(key, None)
            if old is not None:
                self._by_request.pop(old.request_id, None)
            entry = _Entry(request_id)
            self._by_key[key] = entry
            self._by_request[request_id] = entry
            while len(self._by_key) > self._max_tracked:
                _, dropped = self._by_key.popitem(last=False)
                self._by_request.pop(dropped.request_id, None)

    def update(self, stats: EngineStats) -> None:
        with self._lock:
            for item in stats.progress:
                entry = self._by_request.get(item.request_id)
                if entry is not None and entry.status in ("queued", "running"):
                    entry.status, entry.step, entry.total = "running", item.step, item.total

    def finish(self, request_id: str, *, ok: bool) -> None:
        with self._lock:
            entry = self._by_request.pop(request_id, None)
            if entry is not None:
                entry.status = "done" if ok else "failed"
                if ok:
                    entry.step = entry.total

    def get(self, key: str) -> dict[str, object] | None:
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None:
                return None
            return {"key": key, "status": entry.status, "step": entry.step, "total": entry.total}


def progress_router(board: ProgressBoard) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/progress/{key}")
    async def progress(key: str) -> dict[str, object]:
        state = board.get(key)
        if state is None:
            raise HTTPException(
                404,
                f"no request is tracked under progress key {key!r} (send it as the "
                f"{PROGRESS_HEADER} header of the generation request)",
            )
        return state

    return router
