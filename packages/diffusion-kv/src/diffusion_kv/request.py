"""Scheduler-side descriptions of what one public request needs in the KV cache.

A public request (one client image request) becomes N *execution sequences*,
one per CFG branch, each a ``DiffusionKVRequest`` with ``sequence_id`` 0..N-1
and an ordered ``[prefix | target]`` token layout. Sequences may also reference
request-scoped *contexts* (``DiffusionKVContext``), K/V that lives off the
primary token axis (cross-attention text K/V, AR-decode K/V, ...).

Both are Scheduler-only state: they never travel to a Worker (Workers receive
``diffusion_kv.metadata`` snapshots instead). ``DiffusionKVRequest`` and the
internal context shim expose exactly the small mutable surface that vLLM's
``KVCacheManager`` reads from a ``vllm.v1.request.Request``, so the native
manager can allocate for them directly; this module never imports vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diffusion_kv._validation import is_int

# vLLM's BlockHash is ``NewType("BlockHash", bytes)``; the alias keeps this
# module importable without vLLM while naming the same thing.
BlockHash = bytes

_INTERNAL_ID_INFIX = "diffusion-kv"


class RequestStatus(enum.IntEnum):
    """Request status codes, value-for-value identical to ``vllm.v1.request.RequestStatus``.

    vLLM's enum is an ``IntEnum``, so these members compare equal to the native
    ones; the native ``KVCacheManager`` reads ``request.status`` (watermark
    admission) and gets the same answer as for a native request. A conformance
    test pins the values against the installed vLLM.
    """

    WAITING = 1
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 2
    WAITING_FOR_REMOTE_KVS = 3
    WAITING_FOR_STREAMING_REQ = 4
    RUNNING = 5
    PREEMPTED = 6
    # Everything after PREEMPTED is a finished status (as in vLLM).
    FINISHED_STOPPED = 7
    FINISHED_LENGTH_CAPPED = 8
    FINISHED_ABORTED = 9
    FINISHED_IGNORED = 10
    FINISHED_ERROR = 11
    FINISHED_REPETITION = 12

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


def sequence_request_id(public_request_id: str, sequence_id: int) -> str:
    """Internal id of CFG row ``sequence_id``: ``"{public}/diffusion-kv/{sequence_id}"``."""
    return f"{public_request_id}/{_INTERNAL_ID_INFIX}/{sequence_id}"


def context_request_id(public_request_id: str, context_id: str) -> str:
    """Internal id of a context row: ``"{public}/diffusion-kv/context/{context_id}"``."""
    return f"{public_request_id}/{_INTERNAL_ID_INFIX}/context/{context_id}"


def _require_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class DiffusionKVContext:
    """A request-scoped K/V context that is not on the primary token axis.

    ``context_id`` identifies the context within one public request. Several
    sequences of the request may reference the same ``context_id``; they must
    then give an identical definition (equality over all four fields) and the
    manager allocates it once, as one row.

    ``cache_role`` binds the context to a logical attention-cache role the
    Worker exposes (for example ``"cross.text"`` or ``"ar_decode"``). Physical
    geometry (heads, head size, dtype, block size) is deliberately absent: it
    belongs to the native KV cache spec/config.

    Single-writer contract: a deduplicated context is ONE Worker row. Exactly
    one forward writes it (through its ``slot_mapping``): the forward that
    produces the context K/V, normally the first forward of the sequence that
    first references it. CFG branches that read a shared context do so in
    separate forwards, because one forward never contains the same row twice;
    no two forwards ever race to write the same context row.

    Contexts are never prefix-cache hits and are never published to the prefix
    cache, whatever ``block_hashes`` they carry.
    """

    context_id: str
    cache_role: str
    num_tokens: int
    block_hashes: tuple[BlockHash, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.context_id, str) or not self.context_id:
            raise ValueError("context_id must be non-empty")
        if not isinstance(self.cache_role, str) or not self.cache_role:
            raise ValueError("cache_role must be non-empty")
        if _require_int("num_tokens", self.num_tokens) <= 0:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))


class _NativeRequestSurface:
    """The attributes of a ``vllm.v1.request.Request`` that vLLM's ``KVCacheManager`` reads.

    Shared by ``DiffusionKVRequest`` and the context shim; every row starts
    ``WAITING`` with nothing computed.
    """

    __slots__ = (
        "request_id",
        "num_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_hashes",
        "skip_reading_prefix_cache",
        "status",
        "num_preemptions",
        "num_in_flight_tokens",
        "shared_prefix_boundary",
        "prompt_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        *,
        num_tokens: int,
        num_prompt_tokens: int,
        block_hashes: list[BlockHash],
        skip_reading_prefix_cache: bool,
        prompt_token_ids: list[int] | None,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_hashes = block_hashes
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        # vLLM 0.26+ reads this when publishing cached blocks; 0 = no
        # sparse-retention boundary.
        self.shared_prefix_boundary = 0
        self.prompt_token_ids = prompt_token_ids


class DiffusionKVRequest(_NativeRequestSurface):
    """One execution sequence (CFG row) of a public request: ``[prefix | target]``.

    ``request_id`` is the internal id, by convention
    ``sequence_request_id(public_id, sequence_id)``. ``prefix_len`` is the
    contiguous reusable prefix (text tokens), ``target_len`` the span every
    denoise step overwrites (image tokens), ``seq_len`` the full first-step
    allocation boundary (``prefix_len + target_len <= seq_len``).

    Empty ``block_hashes`` means the prefix has no canonical cache identity
    yet: the row gets request-local pages and is never published.

    The object is Scheduler-only mutable state. The attributes set by
    ``_NativeRequestSurface`` are the native ``Request`` surface read by vLLM's
    ``KVCacheManager``; the manager mutates ``num_computed_tokens`` and
    ``shared_prefix_boundary`` and resets them on release.
    """

    __slots__ = ("sequence_id", "prefix_len", "target_len", "kv_contexts")

    def __init__(
        self,
        request_id: str,
        *,
        sequence_id: int,
        prefix_len: int,
        target_len: int,
        seq_len: int,
        block_hashes: Iterable[BlockHash] = (),
        kv_contexts: Iterable[DiffusionKVContext] = (),
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be non-empty")
        if _require_int("sequence_id", sequence_id) < 0:
            raise ValueError(f"sequence_id must be non-negative, got {sequence_id}")
        if _require_int("prefix_len", prefix_len) < 0:
            raise ValueError(f"prefix_len must be non-negative, got {prefix_len}")
        if _require_int("target_len", target_len) <= 0:
            raise ValueError(f"target_len must be positive, got {target_len}")
        if _require_int("seq_len", seq_len) <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if prefix_len + target_len > seq_len:
            raise ValueError(
                "prefix_len + target_len must not exceed seq_len: "
                f"prefix_len={prefix_len}, target_len={target_len}, seq_len={seq_len}"
            )
        contexts = tuple(kv_contexts)
        if not all(isinstance(context, DiffusionKVContext) for context in contexts):
            raise TypeError("kv_contexts must contain only DiffusionKVContext values")
        context_ids = [context.context_id for context in contexts]
        if len(set(context_ids)) != len(context_ids):
            raise ValueError(f"kv_contexts must have unique context_id values, got {context_ids}")

        self.sequence_id = sequence_id
        self.prefix_len = prefix_len
        self.target_len = target_len
        self.kv_contexts: tuple[DiffusionKVContext, ...] = contexts
        hashes = list(block_hashes)
        super().__init__(
            request_id,
            num_tokens=seq_len,
            num_prompt_tokens=prefix_len,
            block_hashes=hashes,
            skip_reading_prefix_cache=not hashes,
            prompt_token_ids=prompt_token_ids,
        )

    @property
    def seq_len(self) -> int:
        """Full first-step allocation length (alias of the native ``num_tokens``)."""
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"DiffusionKVRequest({self.request_id!r}, sequence_id={self.sequence_id}, "
            f"prefix_len={self.prefix_len}, target_len={self.target_len}, seq_len={self.seq_len}, "
            f"contexts={[context.context_id for context in self.kv_contexts]})"
        )


class _ContextKVRequest(_NativeRequestSurface):
    """Native-request-shaped shim through which the allocator reserves one context row.

    The manager keeps shims apart from the sequence collection, so no
    sequence-only policy (prefix lookup/publication, sequence metadata) can
    mistake a context for an execution sequence. A shim never reads the prefix
    cache (``skip_reading_prefix_cache`` is always True).
    """

    __slots__ = ("context",)

    def __init__(self, public_request_id: str, context: DiffusionKVContext) -> None:
        self.context = context
        super().__init__(
            context_request_id(public_request_id, context.context_id),
            num_tokens=context.num_tokens,
            num_prompt_tokens=context.num_tokens,
            block_hashes=list(context.block_hashes),
            skip_reading_prefix_cache=True,
            prompt_token_ids=None,
        )

    @property
    def context_id(self) -> str:
        return self.context.context_id

    def __repr__(self) -> str:
        return f"_ContextKVRequest({self.request_id!r}, num_tokens={self.num_tokens})"


__all__ = [
    "BlockHash",
    "DiffusionKVContext",
    "DiffusionKVRequest",
    "RequestStatus",
    "context_request_id",
    "sequence_request_id",
]
