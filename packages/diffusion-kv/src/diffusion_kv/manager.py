"""Atomic public-request reservation over a block allocator.

One public request = N CFG rows (``DiffusionKVRequest``, sequence ids 0..N-1)
plus the deduplicated request-scoped contexts they reference. The manager
reserves all of them or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from diffusion_kv._validation import is_positive_int
from diffusion_kv.allocator import AllocatorChoice, BlockAllocator, BlockPoolConfig, build_block_allocator
from diffusion_kv.errors import DiffusionKVAdmissionError, DiffusionKVInvariantError
from diffusion_kv.metadata import (
    DiffusionKVContextMetadata,
    DiffusionKVMetadata,
    DiffusionKVSequenceMetadata,
)
from diffusion_kv.request import DiffusionKVContext, DiffusionKVRequest, _ContextKVRequest, sequence_request_id

_Row = DiffusionKVRequest | _ContextKVRequest


class _Reservation(NamedTuple):
    """A checked reservation: its sequences, its deduplicated contexts and their shims, every row's internal
    id, and the blocks the rows take from the pool."""

    sequences: tuple[DiffusionKVRequest, ...]
    contexts: tuple[DiffusionKVContext, ...]
    context_ids_by_sequence: Sequence[tuple[str, ...]]
    shims: tuple[_ContextKVRequest, ...]
    internal_ids: list[str]
    required_blocks: int

    @property
    def rows(self) -> tuple[_Row, ...]:
        """Allocation order: sequences, then contexts."""
        return self.sequences + self.shims


class DiffusionKVCacheManager:
    """Reserves every row of a public request atomically, or nothing.

    Invariants (checked by the tests after every operation):

    - a public request is either fully reserved (every CFG row and every
      deduplicated context owns its blocks, and its metadata is stored) or
      absent: no partial ownership survives any call, including one whose
      allocator raises after handing out blocks;
    - internal row ids are unique across live reservations; context rows live
      in ``_context_requests``, apart from the sequence rows in ``_requests``,
      so sequence-only policies never see them;
    - ``allocation_generation`` values are manager-global and strictly
      increasing from 1; a reused public id gets a new, higher one;
    - ``close()`` (or freeing every request) returns the pool to its idle
      free-block count.

    Outcomes of ``reserve_request``: metadata (reserved); ``None`` (no space
    now: retry after a release); ``DiffusionKVAdmissionError`` (request-caused,
    never fits as written); ``DiffusionKVInvariantError`` (bookkeeping broken,
    engine-fatal). An exception raised by the allocator itself is re-raised
    unchanged after the partial reservation has been undone.

    There is no aggregate Worker-row gate here: the scheduler bounds the
    reservations it makes to the rows of at most ``max_num_seqs`` requests
    (``DiffusionKVScheduler.worker_row_pool_size``) and asserts it.
    """

    def __init__(
        self,
        kv_cache_config: Any,
        *,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_rows_per_request: int,
        max_in_flight_tokens: int | None = None,
        allocator: AllocatorChoice | BlockAllocator = "auto",
    ) -> None:
        """``kv_cache_config``: a vLLM ``KVCacheConfig`` or a ``BlockPoolConfig``.

        ``allocator``: ``"auto"`` (vLLM's ``KVCacheManager`` when vLLM is
        importable, else the built-in pool), ``"native"``, ``"builtin"``, or a
        ready ``BlockAllocator`` built for this config.
        """
        if not is_positive_int(max_model_len):
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        num_blocks = getattr(kv_cache_config, "num_blocks", 0)
        has_groups = bool(getattr(kv_cache_config, "kv_cache_groups", True))
        if not is_positive_int(num_blocks) or not has_groups:
            raise ValueError("Diffusion KVCacheConfig must contain a positive block pool and at least one group")
        if not (is_positive_int(scheduler_block_size) and is_positive_int(hash_block_size)):
            raise ValueError("scheduler_block_size and hash_block_size must be positive")
        if isinstance(kv_cache_config, BlockPoolConfig) and scheduler_block_size != kv_cache_config.block_size:
            raise ValueError(
                f"scheduler_block_size ({scheduler_block_size}) must equal the pool's block_size "
                f"({kv_cache_config.block_size}): a BlockPoolConfig has one KV-cache group"
            )
        if not is_positive_int(max_rows_per_request):
            raise ValueError(f"max_rows_per_request must be a positive integer, got {max_rows_per_request!r}")
        if max_in_flight_tokens is not None and not is_positive_int(max_in_flight_tokens):
            raise ValueError(f"max_in_flight_tokens must be positive when provided, got {max_in_flight_tokens}")
        if isinstance(allocator, str):
            allocator = build_block_allocator(
                kv_cache_config,
                allocator=allocator,
                max_model_len=max_model_len,
                scheduler_block_size=scheduler_block_size,
                hash_block_size=hash_block_size,
                max_in_flight_tokens=max_in_flight_tokens,
            )
        elif not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be 'auto', 'native', 'builtin' or a BlockAllocator, got {allocator!r}")

        self.allocator: BlockAllocator = allocator
        self.max_model_len = max_model_len
        self.max_rows_per_request = max_rows_per_request
        # The idle figure, fixed at construction: the "can never fit" bound
        # must not depend on what other requests hold right now.
        self._empty_pool_num_free_blocks = allocator.empty_pool_free_blocks
        self._requests: dict[str, tuple[DiffusionKVRequest, ...]] = {}
        self._context_requests: dict[str, tuple[_ContextKVRequest, ...]] = {}
        self._metadata: dict[str, DiffusionKVMetadata] = {}
        self._internal_request_ids: set[str] = set()
        self._next_allocation_generation = 1

    # -- queries -------------------------------------------------------------------

    @property
    def native_manager(self) -> Any:
        """vLLM's ``KVCacheManager`` behind the native allocator; ``None`` for the built-in pool."""
        return getattr(self.allocator, "native_manager", None)

    @property
    def empty_pool_num_free_blocks(self) -> int:
        return self._empty_pool_num_free_blocks

    def get_num_free_blocks(self) -> int:
        return self.allocator.get_num_free_blocks()

    def has_request(self, public_request_id: str) -> bool:
        """True while the reservation is live (from ``reserve_request`` until ``free_request``)."""
        return public_request_id in self._metadata

    def get_metadata(self, public_request_id: str) -> DiffusionKVMetadata:
        try:
            return self._metadata[public_request_id]
        except KeyError:
            raise KeyError(f"Diffusion KV request {public_request_id!r} is not allocated") from None

    @property
    def num_requests(self) -> int:
        return len(self._metadata)

    # -- reservation -----------------------------------------------------------------

    def blocks_required(self, public_request_id: str, kv_requests: Sequence[DiffusionKVRequest]) -> int:
        """Blocks ``reserve_request`` takes from the pool for this request: every CFG row and every
        deduplicated context.

        Runs exactly the checks ``reserve_request`` runs before its first allocation and raises what it
        would raise (``DiffusionKVAdmissionError`` for a request that can never be admitted as written,
        one that cannot fit even the empty pool included); it never touches the pool.
        """
        return self._plan_reservation(public_request_id, kv_requests).required_blocks

    def reserve_request(
        self,
        public_request_id: str,
        kv_requests: Sequence[DiffusionKVRequest],
    ) -> DiffusionKVMetadata | None:
        """Reserve every CFG row and every deduplicated context, or nothing.

        Every check (``blocks_required``) runs before the first allocation, so a rejected
        request never touches the pool.
        """
        plan = self._plan_reservation(public_request_id, kv_requests)
        block_ids = self._allocate_rows(plan.rows)
        if block_ids is None:
            return None

        # Positional construction: this is the hot path of every admission.
        sequences, contexts, context_ids_by_sequence = plan.sequences, plan.contexts, plan.context_ids_by_sequence
        num_sequences = len(sequences)
        metadata = DiffusionKVMetadata(
            public_request_id,
            self._next_allocation_generation,
            tuple(
                [
                    DiffusionKVSequenceMetadata(
                        sequence.sequence_id,
                        sequence.prefix_len,
                        sequence.target_len,
                        sequence.num_tokens,
                        block_ids[index],
                        context_ids_by_sequence[index],
                        sequence.num_computed_tokens,
                    )
                    for index, sequence in enumerate(sequences)
                ]
            ),
            tuple(
                [
                    DiffusionKVContextMetadata(
                        context.context_id, context.cache_role, context.num_tokens, block_ids[num_sequences + index]
                    )
                    for index, context in enumerate(contexts)
                ]
            ),
        )
        self._next_allocation_generation += 1
        self._requests[public_request_id] = sequences
        self._context_requests[public_request_id] = plan.shims
        self._metadata[public_request_id] = metadata
        self._internal_request_ids.update(plan.internal_ids)
        return metadata

    def _plan_reservation(self, public_request_id: str, kv_requests: Sequence[DiffusionKVRequest]) -> _Reservation:
        """Every pre-allocation check of a reservation; the rows to allocate and the blocks they take."""
        if not isinstance(public_request_id, str) or not public_request_id:
            raise DiffusionKVAdmissionError("public_request_id must be non-empty")
        if public_request_id in self._metadata:
            raise DiffusionKVAdmissionError(f"Diffusion KV request {public_request_id!r} is already allocated")
        sequences = tuple(kv_requests)
        if not sequences:
            raise DiffusionKVAdmissionError("Diffusion KV allocation requires at least one sequence")
        has_contexts = False
        for sequence in sequences:
            if not isinstance(sequence, DiffusionKVRequest):
                raise DiffusionKVAdmissionError("Diffusion KV allocation accepts only DiffusionKVRequest sequences")
            has_contexts = has_contexts or bool(sequence.kv_contexts)

        if has_contexts:
            contexts, context_ids_by_sequence = _collect_contexts(sequences)
        else:  # the common CFG case: skip the dedup pass
            contexts, context_ids_by_sequence = (), [()] * len(sequences)
        num_rows = len(sequences) + len(contexts)
        if num_rows > self.max_rows_per_request:
            raise DiffusionKVAdmissionError(
                f"Diffusion KV request {public_request_id!r} requires {num_rows} rows; "
                f"max_rows_per_request is {self.max_rows_per_request}"
            )
        sequence_ids = [sequence.sequence_id for sequence in sequences]
        if sequence_ids != list(range(len(sequences))):
            raise DiffusionKVAdmissionError(
                "Diffusion KV requests must be ordered by contiguous sequence_id values: "
                f"expected={list(range(len(sequences)))}, got={sequence_ids}"
            )
        shims = tuple([_ContextKVRequest(public_request_id, context) for context in contexts])
        rows: tuple[_Row, ...] = sequences + shims
        internal_ids = [row.request_id for row in rows]
        if len(set(internal_ids)) != len(internal_ids):
            raise DiffusionKVAdmissionError(f"Diffusion KV internal request IDs must be unique, got {internal_ids}")
        max_model_len = self.max_model_len
        for sequence in sequences:
            expected_id = sequence_request_id(public_request_id, sequence.sequence_id)
            if sequence.request_id != expected_id:
                raise DiffusionKVAdmissionError(
                    f"Diffusion KV sequence {sequence.sequence_id} of request {public_request_id!r} must have "
                    f"request_id {expected_id!r} (sequence_request_id), got {sequence.request_id!r}"
                )
            if sequence.num_tokens > max_model_len:
                raise DiffusionKVAdmissionError(
                    f"Diffusion KV sequence {sequence.request_id!r} exceeds max_model_len: "
                    f"seq_len={sequence.num_tokens}, max_model_len={max_model_len}"
                )
        for context in contexts:
            if context.num_tokens > max_model_len:
                raise DiffusionKVAdmissionError(
                    f"Diffusion KV context {context.context_id!r} exceeds max_model_len: "
                    f"num_tokens={context.num_tokens}, max_model_len={max_model_len}"
                )
        leaked = self._internal_request_ids.intersection(internal_ids)
        if leaked:
            # Internal ids derive from the public id, which is not live, so
            # these rows cannot belong to a live request: the tables leaked.
            raise DiffusionKVInvariantError(
                f"Diffusion KV internal request IDs are already allocated: {sorted(leaked)}"
            )
        blocks_for = self.allocator.blocks_for_full_reservation
        required_blocks = sum([blocks_for(row.num_tokens) for row in rows])
        if required_blocks > self._empty_pool_num_free_blocks:
            raise DiffusionKVAdmissionError(
                f"Diffusion KV request {public_request_id!r} cannot fit even when the block pool is empty: "
                f"required_blocks={required_blocks}, available_blocks={self._empty_pool_num_free_blocks}; "
                "increase KV cache capacity or reduce the request sequence/context count or length"
            )
        return _Reservation(sequences, contexts, context_ids_by_sequence, shims, internal_ids, required_blocks)

    def _allocate_rows(self, rows: Sequence[_Row]) -> list[tuple[list[int], ...]] | None:
        """Allocate rows in order (sequences, then contexts); undo all on ``None`` or an exception."""
        attempted: list[_Row] = []
        block_ids: list[tuple[list[int], ...]] = []
        allocate = self.allocator.allocate
        try:
            for row in rows:
                # Join the rollback list BEFORE allocating: an allocator that
                # hands out blocks and then raises must still be undone.
                attempted.append(row)
                row_block_ids = allocate(row)
                if row_block_ids is None:
                    break
                block_ids.append(row_block_ids)
            else:
                return block_ids
        except BaseException:
            self._rollback(attempted)
            raise
        self._rollback(attempted)
        return None

    def _rollback(self, rows: Sequence[_Row]) -> None:
        """Free attempted rows in reverse, through the same physical-order path as ``free_request``."""
        try:
            for row in reversed(rows):
                self._free_row(row)
        except BaseException as exc:
            raise DiffusionKVInvariantError(
                f"Diffusion KV rollback failed; allocator ownership is unknown for {[row.request_id for row in rows]}"
            ) from exc

    # -- release ---------------------------------------------------------------------

    def _free_row(self, row: _Row) -> None:
        """Return the row's blocks and reset the native progress fields the allocation advanced."""
        self.allocator.free(row)
        row.num_computed_tokens = 0
        row.shared_prefix_boundary = 0

    def free_request(self, public_request_id: str) -> None:
        """Release every row of the request; an unknown id is a no-op (idempotent)."""
        metadata = self._metadata.pop(public_request_id, None)
        if metadata is None:
            return
        sequences = self._requests.pop(public_request_id)
        shims = self._context_requests.pop(public_request_id)
        # Contexts first, then sequences, each in reverse: the exact reverse of
        # allocation order, through the same physical-order path as rollback.
        for row in (*reversed(shims), *reversed(sequences)):
            self._free_row(row)
            self._internal_request_ids.discard(row.request_id)

    def close(self) -> None:
        """Free every live reservation; the pool returns to its idle free count."""
        for public_request_id in tuple(self._metadata):
            self.free_request(public_request_id)

    # -- invariants --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``DiffusionKVInvariantError`` if the ownership tables disagree.

        Checks: the three per-request tables have the same keys; the internal
        id set is exactly the rows of live requests; the allocator owns blocks
        for exactly those rows; free + owned blocks equal the idle pool.
        """
        keys = set(self._metadata)
        if keys != set(self._requests) or keys != set(self._context_requests):
            raise DiffusionKVInvariantError("Diffusion KV ownership tables disagree on live public requests")
        expected_ids = {row.request_id for rows in self._requests.values() for row in rows}
        expected_ids.update(row.request_id for rows in self._context_requests.values() for row in rows)
        if expected_ids != self._internal_request_ids:
            raise DiffusionKVInvariantError(
                "Diffusion KV internal id table is out of sync: "
                f"leaked={sorted(self._internal_request_ids - expected_ids)}, "
                f"missing={sorted(expected_ids - self._internal_request_ids)}"
            )
        owned = self.allocator.owned_request_ids()
        if owned != expected_ids:
            raise DiffusionKVInvariantError(
                "Allocator ownership differs from live rows: "
                f"orphaned={sorted(owned - expected_ids)}, missing={sorted(expected_ids - owned)}"
            )
        held = sum(
            len(group)
            for metadata in self._metadata.values()
            for row in (*metadata.sequences, *metadata.contexts)
            for group in row.block_ids
        )
        if self.get_num_free_blocks() + held != self._empty_pool_num_free_blocks:
            raise DiffusionKVInvariantError(
                f"Block accounting is off: free={self.get_num_free_blocks()}, held={held}, "
                f"idle={self._empty_pool_num_free_blocks}"
            )


def _collect_contexts(
    sequences: Sequence[DiffusionKVRequest],
) -> tuple[tuple[DiffusionKVContext, ...], list[tuple[str, ...]]]:
    """Deduplicate contexts in first-seen order; each sequence keeps its declared id order."""
    unique: dict[str, DiffusionKVContext] = {}
    context_ids_by_sequence: list[tuple[str, ...]] = []
    for sequence in sequences:
        for context in sequence.kv_contexts:
            first = unique.setdefault(context.context_id, context)
            if first is not context and first != context:
                raise DiffusionKVAdmissionError(
                    "Diffusion KV sequences define conflicting request-scoped contexts: "
                    f"context_id={context.context_id!r}"
                )
        context_ids_by_sequence.append(tuple(context.context_id for context in sequence.kv_contexts))
    return tuple(unique.values()), context_ids_by_sequence


__all__ = ["DiffusionKVCacheManager"]
