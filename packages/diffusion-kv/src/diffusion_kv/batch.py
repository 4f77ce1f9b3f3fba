"""Per-forward batch preparation over installed rows, and role-checked paged attention.

One forward runs a ragged batch of rows. For each row it writes the K/V of a query span
`[kv_start_pos, kv_start_pos + query_len)` into the row's pages and attends over keys
`[0, seq_len)`. `prepare_batch` checks the rows against the worker's row table and builds
the kernel inputs once per forward; every cache-enabled layer of that forward then calls
`PreparedBatch.attention`.

Rules:
- one forward touches rows of exactly one cache role, and a layer may only run on rows
  of its own role (a layer never reads another role's cache);
- a row appears at most once per forward (so a shared context has a single writer per
  forward; CFG branches that read it do so in separate forwards);
- the slot mapping covers only the span this forward writes:
  `slot = block_ids[pos // block_size] * block_size + pos % block_size`;
- a batch is bound to the row-table version it was built from; after any install or
  retire it is stale, because retired blocks may already back another request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_kv._validation import is_positive_int
from diffusion_kv.ops import paged_attention, write_kv_cache
from diffusion_kv.specs import AttentionCacheSpec
from diffusion_kv.worker import RowIdentity, WorkerRowTable


@dataclass(frozen=True)
class BatchRow:
    """One row's work in a forward.

    `query_len` tokens at positions `kv_start_pos..kv_start_pos+query_len-1` are written and
    attend to keys `0..seq_len-1`. `causal_prefix_len`, when set, makes queries before that
    position attend causally (text prefix) while later ones attend to all keys.
    """

    identity: RowIdentity
    query_len: int
    seq_len: int
    kv_start_pos: int = 0
    causal_prefix_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.identity, RowIdentity):
            raise TypeError(f"identity must be a RowIdentity, got {type(self.identity).__name__}")
        for name in ("query_len", "seq_len"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"row {self.identity}: {name} must be a positive int, got {value!r}")
        if not isinstance(self.kv_start_pos, int) or self.kv_start_pos < 0:
            raise ValueError(f"row {self.identity}: kv_start_pos must be an int >= 0, got {self.kv_start_pos!r}")
        if self.kv_start_pos + self.query_len > self.seq_len:
            raise ValueError(
                f"row {self.identity}: kv_start_pos + query_len ({self.kv_start_pos} + {self.query_len}) "
                f"exceeds seq_len={self.seq_len}"
            )
        if self.causal_prefix_len is not None and (
            not isinstance(self.causal_prefix_len, int) or self.causal_prefix_len < 0
        ):
            raise ValueError(f"row {self.identity}: causal_prefix_len must be an int >= 0 or None")


@dataclass(frozen=True)
class PreparedBatch:
    """Kernel inputs of one forward (all on the row table's device)."""

    table: WorkerRowTable
    table_version: int
    cache_role: str
    rows: tuple[BatchRow, ...]
    row_indices: Tensor  # int32 [R]
    block_tables: Tensor  # int32 [R, max_blocks_per_row]
    query_start_loc: Tensor  # int32 [R + 1]
    seq_lens: Tensor  # int32 [R]
    query_pos_start: Tensor  # int32 [R]
    slot_mapping: Tensor  # int64 [num_tokens]
    causal_prefix_lens: Tensor | None  # int32 [R], 0 for rows without a causal prefix
    num_tokens: int
    max_query_len: int

    def check_layer(self, layer: AttentionCacheSpec) -> None:
        """Reject a layer of another cache role, or a batch the row table has moved past."""
        if layer.cache_role != self.cache_role:
            raise ValueError(
                f"Paged attention layer {layer.layer_name!r} uses cache role {layer.cache_role!r}, "
                f"but the active rows use {self.cache_role!r}"
            )
        if self.table.version != self.table_version:
            raise RuntimeError(
                "Paged attention batch is stale: rows were installed or retired after it was prepared; "
                "prepare the batch again"
            )

    def attention(
        self,
        layer: AttentionCacheSpec,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        *,
        scale: float | None = None,
    ) -> Tensor:
        """Write this forward's K/V into `kv_cache`, then attend; the output has the query's layout.

        Token layouts: packed `[num_tokens, heads, head_size]` or `[num_tokens, heads * head_size]`
        (tokens row by row, as in `rows`), or batched `[R, query_len, ...]` when every row has the
        same `query_len`. A 3-D tensor whose last dim is `head_size` is read as packed
        `[num_tokens, heads, head_size]`. K/V may be views of a packed QKV projection.
        """
        self.check_layer(layer)
        q = self._tokens_heads_dim(layer, "query", query)
        k = self._tokens_heads_dim(layer, "key", key)
        v = self._tokens_heads_dim(layer, "value", value)
        write_kv_cache(k, v, kv_cache, self.slot_mapping)
        out = paged_attention(
            q, kv_cache, self.block_tables, self.query_start_loc, self.seq_lens, self.query_pos_start,
            scale=scale, causal_prefix_lens=self.causal_prefix_lens, max_query_len=self.max_query_len,
        )
        return out.view(query.shape)

    def _tokens_heads_dim(self, layer: AttentionCacheSpec, name: str, x: Tensor) -> Tensor:
        """View `x` as `[num_tokens, heads, head_size]` without copying (strided views stay views)."""
        head_size = layer.head_size
        uniform = all(row.query_len == self.max_query_len for row in self.rows)
        if x.dim() == 3 and x.shape[0] == self.num_tokens and x.shape[2] == head_size:
            return x
        if x.dim() == 2 and x.shape[0] == self.num_tokens and x.shape[1] % head_size == 0:
            return x.unflatten(1, (-1, head_size))
        if uniform and x.dim() in (3, 4) and tuple(x.shape[:2]) == (len(self.rows), self.max_query_len):
            tokens = x.flatten(0, 1)
            if tokens.dim() == 3 and tokens.shape[2] == head_size:
                return tokens
            if tokens.dim() == 2 and tokens.shape[1] % head_size == 0:
                return tokens.unflatten(1, (-1, head_size))
        layouts = f"[{self.num_tokens}, heads, {head_size}] or [{self.num_tokens}, heads*{head_size}]"
        if uniform:
            layouts += f" or [{len(self.rows)}, {self.max_query_len}, ...]"
        raise ValueError(f"layer {layer.layer_name!r}: {name} of shape {tuple(x.shape)} is not {layouts}")


def prepare_batch(
    table: WorkerRowTable, rows: Sequence[BatchRow], *, max_num_batched_tokens: int | None = None
) -> PreparedBatch:
    """Validate one forward's rows against the installed table and build its kernel inputs."""
    if not rows:
        raise ValueError("Paged attention batch is empty; a forward needs at least one row")
    if len(rows) > table.num_rows:
        raise ValueError(f"Paged attention batch has {len(rows)} rows; Worker capacity is {table.num_rows}")
    identities = [row.identity for row in rows]
    if len(set(identities)) != len(identities):
        raise ValueError("Paged attention batch contains duplicate row identities")
    installed = [table.row(identity) for identity in identities]
    roles = sorted({row.cache_role for row in installed})
    if len(roles) != 1:
        raise ValueError(f"Paged attention rows must use one cache role per forward; got {roles}")
    num_tokens = sum(row.query_len for row in rows)
    if max_num_batched_tokens is not None and num_tokens > max_num_batched_tokens:
        raise ValueError(
            f"Paged attention batch has {num_tokens} tokens, more than max_num_batched_tokens={max_num_batched_tokens}"
        )
    block_size = table.block_size
    slots: list[Tensor] = []
    for row, entry in zip(rows, installed):
        if row.seq_len > entry.num_tokens:
            raise ValueError(
                f"row {row.identity}: seq_len={row.seq_len} is beyond its installed length of {entry.num_tokens} tokens"
            )
        positions = torch.arange(row.kv_start_pos, row.kv_start_pos + row.query_len)
        block_ids = torch.tensor(entry.block_ids, dtype=torch.int64)
        slots.append(block_ids[positions // block_size] * block_size + positions % block_size)
    query_start_loc = [0]
    for row in rows:
        query_start_loc.append(query_start_loc[-1] + row.query_len)
    device = table.device
    row_indices = torch.tensor([entry.index for entry in installed], dtype=torch.int32, device=device)
    has_causal = any(row.causal_prefix_len is not None for row in rows)

    def int32(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PreparedBatch(
        table=table,
        table_version=table.version,
        cache_role=roles[0],
        rows=tuple(rows),
        row_indices=row_indices,
        block_tables=table.block_tables.index_select(0, row_indices),
        query_start_loc=int32(query_start_loc),
        seq_lens=int32([row.seq_len for row in rows]),
        query_pos_start=int32([row.kv_start_pos for row in rows]),
        slot_mapping=torch.cat(slots).to(device),
        causal_prefix_lens=int32([row.causal_prefix_len or 0 for row in rows]) if has_causal else None,
        num_tokens=num_tokens,
        max_query_len=max(row.query_len for row in rows),
    )
