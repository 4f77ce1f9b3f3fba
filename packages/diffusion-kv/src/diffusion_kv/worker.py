"""Worker row table: the block tables of installed requests, one row per allocation identity.

A fixed pool of `num_rows` rows (sized `max_num_seqs * max_rows_per_request` by the control
plane) holds the block ids of every scheduled request's rows: one row per primary sequence
(identity `(request_id, sequence_id, None)`, role `"primary"`) and one per request-scoped
context (identity `(request_id, None, context_id)`, the context's role). Primary and
context rows share one install path and are retired together.

Invariants:
- a row is either free (on the free stack, zero-length) or holds exactly one identity;
- every installed request's rows were installed by one `DiffusionKVMetadata` snapshot,
  and the table remembers its `allocation_generation`;
- a failed install changes nothing (everything is validated before any write);
- retiring by `(request_id, generation)` only removes that generation's rows, so cleanup
  addressed to an old allocation never removes a reused request id's new rows.
The table never frees Scheduler-owned blocks: it only forgets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from diffusion_kv._validation import cdiv, check_positive_int, is_int
from diffusion_kv.metadata import DiffusionKVMetadata
from diffusion_kv.specs import PRIMARY_CACHE_ROLE


@dataclass(frozen=True)
class RowIdentity:
    """Who owns a row: a primary sequence xor a request-scoped context of one request."""

    request_id: str
    sequence_id: int | None = None
    context_id: str | None = None

    def __post_init__(self) -> None:
        if (self.sequence_id is None) == (self.context_id is None):
            raise ValueError(
                f"a row identity needs exactly one of sequence_id / context_id, got "
                f"sequence_id={self.sequence_id!r}, context_id={self.context_id!r}"
            )

    def __str__(self) -> str:
        which = f"sequence {self.sequence_id}" if self.sequence_id is not None else f"context {self.context_id!r}"
        return f"{self.request_id!r} {which}"


@dataclass(frozen=True)
class InstalledRow:
    """One installed row: its table index, role and logical length (its block ids live in `block_tables`)."""

    index: int
    identity: RowIdentity
    cache_role: str
    num_tokens: int


@dataclass(frozen=True)
class _InstalledRequest:
    generation: int
    snapshot: DiffusionKVMetadata  # with the generation it was first installed under
    rows: tuple[InstalledRow, ...]


class WorkerRowTable:
    """Fixed pool of block-table rows on one rank (host bookkeeping + a device block table)."""

    def __init__(
        self,
        *,
        num_rows: int,
        max_rows_per_request: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        registered_roles: Iterable[str],
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_rows", num_rows),
            ("max_rows_per_request", max_rows_per_request),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_model_len", max_model_len),
        ):
            check_positive_int(name, value)
        if num_rows % max_rows_per_request:
            raise ValueError(
                f"num_rows ({num_rows}) must be a multiple of max_rows_per_request ({max_rows_per_request}): "
                "size it max_num_seqs * max_rows_per_request"
            )
        self.num_rows = num_rows
        self.max_rows_per_request = max_rows_per_request
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_row = cdiv(max_model_len, block_size)
        self.registered_roles = frozenset(registered_roles)
        if not self.registered_roles:
            raise ValueError("registered_roles is empty: no cache-enabled layer exposes a role")
        self.device = torch.device(device)
        self.block_tables = torch.zeros(num_rows, self.max_blocks_per_row, dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._rows: dict[RowIdentity, InstalledRow] = {}
        self._requests: dict[str, _InstalledRequest] = {}
        # Bumped by every change of the table; a prepared batch records it and is stale after.
        self.version = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def installed_request_ids(self) -> frozenset[str]:
        return frozenset(self._requests)

    def generation_of(self, request_id: str) -> int | None:
        installed = self._requests.get(request_id)
        return installed.generation if installed is not None else None

    def row(self, identity: RowIdentity) -> InstalledRow:
        """The installed row of `identity`, or KeyError saying what is installed."""
        try:
            return self._rows[identity]
        except KeyError:
            raise KeyError(
                f"Diffusion KV row {identity} is not installed on this worker; install its request's "
                "metadata before preparing a batch"
            ) from None

    # -- install ---------------------------------------------------------------------------

    def install(self, metadata: DiffusionKVMetadata) -> bool:
        """Install a request's rows from its allocation snapshot; True if rows were written.

        For a request already installed: a lower generation is stale (error), a different
        snapshot conflicts (error: remove the request first), the same generation is a
        no-op, and a higher generation with an identical snapshot only records the new
        generation. Every check runs before any write.
        """
        self._validate_envelope(metadata)
        installed = self._requests.get(metadata.request_id)
        if installed is not None:
            return self._reinstall(installed, metadata)
        rows = self._validate_rows(metadata)
        orphans = [str(identity) for identity, *_ in rows if identity in self._rows]
        if orphans:
            raise RuntimeError(f"Diffusion KV row registry contains orphaned identities: {orphans}")
        if len(rows) > len(self._free_rows):
            raise ValueError(
                f"Diffusion KV request {metadata.request_id!r} requires {len(rows)} rows, but only "
                f"{len(self._free_rows)} rows are free"
            )
        indices = [self._free_rows[-1 - i] for i in range(len(rows))]
        staged = torch.zeros(len(rows), self.max_blocks_per_row, dtype=torch.int32)
        for i, (_, _, _, block_ids) in enumerate(rows):
            staged[i, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.block_tables[torch.tensor(indices, device=self.device)] = staged.to(self.device)
        # Commit host state only after the device write succeeded.
        self.version += 1
        del self._free_rows[len(self._free_rows) - len(rows) :]
        installed_rows = tuple(
            InstalledRow(index, identity, role, num_tokens)
            for index, (identity, role, num_tokens, _) in zip(indices, rows, strict=True)
        )
        for row in installed_rows:
            self._rows[row.identity] = row
        self._requests[metadata.request_id] = _InstalledRequest(
            metadata.allocation_generation, metadata, installed_rows
        )
        return True

    def _reinstall(self, installed: _InstalledRequest, metadata: DiffusionKVMetadata) -> bool:
        request_id, generation = metadata.request_id, metadata.allocation_generation
        if generation < installed.generation:
            raise ValueError(
                f"Stale Diffusion KV allocation generation {generation} for request {request_id!r}; "
                f"installed generation is {installed.generation}"
            )
        old = installed.snapshot
        if (old.sequences, old.contexts) != (metadata.sequences, metadata.contexts):
            raise ValueError(
                f"Conflicting Diffusion KV allocation snapshot for active request {request_id!r}; "
                "remove the request before replacing its rows"
            )
        if generation > installed.generation:
            self._requests[request_id] = _InstalledRequest(generation, old, installed.rows)
        return False

    def _validate_envelope(self, metadata: DiffusionKVMetadata) -> None:
        if not isinstance(metadata, DiffusionKVMetadata):
            raise TypeError(f"install needs a DiffusionKVMetadata, got {type(metadata).__name__}")
        if not isinstance(metadata.request_id, str) or not metadata.request_id:
            raise ValueError(f"Diffusion KV metadata request_id must be a non-empty str, got {metadata.request_id!r}")
        generation = metadata.allocation_generation
        if not is_int(generation) or generation < 0:
            raise ValueError(f"allocation_generation must be an int >= 0, got {generation!r}")
        if not metadata.sequences:
            raise ValueError(f"Diffusion KV request {metadata.request_id!r} has no sequences to install")

    def _validate_rows(self, metadata: DiffusionKVMetadata) -> list[tuple[RowIdentity, str, int, list[int]]]:
        request_id = metadata.request_id
        for context in metadata.contexts:
            if context.cache_role not in self.registered_roles:
                raise ValueError(
                    f"Diffusion KV context {context.context_id!r} uses unregistered cache role "
                    f"{context.cache_role!r}; registered roles={sorted(self.registered_roles)!r}"
                )
        candidates = [
            (RowIdentity(request_id, sequence_id=s.sequence_id), PRIMARY_CACHE_ROLE, s.seq_len, s.block_ids)
            for s in metadata.sequences
        ] + [
            (RowIdentity(request_id, context_id=c.context_id), c.cache_role, c.num_tokens, c.block_ids)
            for c in metadata.contexts
        ]
        if len(candidates) > self.max_rows_per_request:
            raise ValueError(
                f"Diffusion KV request {request_id!r} requires {len(candidates)} rows; max_rows_per_request is "
                f"{self.max_rows_per_request}"
            )
        rows: list[tuple[RowIdentity, str, int, list[int]]] = []
        seen: set[RowIdentity] = set()
        for identity, role, num_tokens, groups in candidates:
            if identity in seen:
                raise ValueError(f"Duplicate diffusion KV row identity: {identity}")
            seen.add(identity)
            if not is_int(num_tokens) or num_tokens < 0:
                raise ValueError(f"Diffusion KV row {identity} token length must be an int >= 0, got {num_tokens!r}")
            if not isinstance(role, str) or not role:
                raise ValueError(f"Diffusion KV row {identity} cache role must be a non-empty str, got {role!r}")
            if len(groups) != 1:
                raise ValueError(f"Diffusion KV row {identity} has {len(groups)} block groups; expected 1")
            block_ids = groups[0]
            if not isinstance(block_ids, list):
                raise ValueError(
                    f"Diffusion KV row {identity} block ids must be a list, got {type(block_ids).__name__}"
                )
            expected = cdiv(num_tokens, self.block_size)
            if len(block_ids) != expected:
                raise ValueError(
                    f"Diffusion KV row {identity} has {len(block_ids)} blocks; expected {expected} for "
                    f"{num_tokens} tokens"
                )
            if expected > self.max_blocks_per_row:
                raise ValueError(
                    f"Diffusion KV row {identity} needs {expected} blocks, beyond the row capacity of "
                    f"{self.max_blocks_per_row} blocks (max_model_len={self.max_model_len})"
                )
            for block_id in block_ids:
                if not is_int(block_id) or not 0 <= block_id < self.num_blocks:
                    raise ValueError(
                        f"Diffusion KV row {identity} holds block id {block_id!r}; ids must be ints in "
                        f"[0, {self.num_blocks})"
                    )
            rows.append((identity, role, num_tokens, list(block_ids)))
        return rows

    # -- retire ----------------------------------------------------------------------------

    def remove(self, targets: Iterable[str | tuple[str, int]]) -> int:
        """Retire requests' rows; returns how many requests were removed.

        A bare id removes whatever is installed under it; `(id, generation)` removes it only
        if that generation is installed (an old cleanup leaves a reused id's rows alone).
        Unknown ids are ignored: retiring is idempotent.
        """
        removed = 0
        for target in targets:
            request_id, generation = (target, None) if isinstance(target, str) else target
            installed = self._requests.get(request_id)
            if installed is None or (generation is not None and generation != installed.generation):
                continue
            indices = [row.index for row in installed.rows]
            self.block_tables[torch.tensor(indices, device=self.device)] = 0
            self.version += 1
            for row in installed.rows:
                del self._rows[row.identity]
            # Reverse order keeps the stack handing out low rows first.
            self._free_rows.extend(sorted(indices, reverse=True))
            del self._requests[request_id]
            removed += 1
        return removed
