"""An LRU cache of prompt embeddings: a served prompt's text encoders run once, not once per request.

Keys are ``(text, settings)``: ``settings`` is whatever changes the encoders' output for the same text (the
pipeline passes its family, the encoders' dtype and device, and the tokens they read, ``max_sequence_length``; a
per-request adapter on the text encoder would add its own identity), so two keys are equal only when the
embeddings are. Values are kept as given and handed out as they are: callers must treat them as read-only (the
families stack them into new tensors, never write into them).

``capacity == 0`` caches nothing (every lookup encodes). Not thread-safe: one engine drives one cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class PromptEmbeddingCache(Generic[V]):
    """Least-recently-used ``(text, settings) -> embedding``, holding at most ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"prompt embedding cache capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, Hashable], V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, Hashable]) -> bool:
        return key in self._entries

    def get_or_encode(self, text: str, settings: Hashable, encode: Callable[[str], V]) -> V:
        """The cached embedding of ``text`` under ``settings``, else ``encode(text)`` (then cached, evicting the
        least recently used entry beyond ``capacity``). An exception from ``encode`` caches nothing."""
        key = (text, settings)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        value = encode(text)
        if self.capacity:
            self._entries[key] = value
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["PromptEmbeddingCache"]
