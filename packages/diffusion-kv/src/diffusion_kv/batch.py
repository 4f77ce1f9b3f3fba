"""Per-forward batch preparation over installed rows, and role-checked paged attention.

One forward runs a ragged batch of rows. For each row it writes the K/V of a query span
`[kv_start_pos, kv_start_pos + query_len)` into the row's pages and attends over keys
`[0, seq_len)`. `prepare_batch` checks the rows against the worker's row table and builds
their `PagedAttentionMetadata` once per forward; every cache-enabled layer of that forward then calls
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
from diffusion_kv.ops import PagedAttentionMetadata, paged_attention, write_kv_cache
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

    @classmethod
    def prefix(cls, identity: RowIdentity, prefix_len: int) -> BatchRow:
        """The forward that writes a `[prefix | target]` row's prefix: its tokens attend causally among themselves."""
        return cls(identity, query_len=prefix_len, seq_len=prefix_len, causal_prefix_len=prefix_len)

    @classmethod
    def target(cls, identity: RowIdentity, prefix_len: int, target_len: int) -> BatchRow:
        """A denoise forward of a `[prefix | target]` row: the target span is written after the prefix and
        attends to every key, the cached prefix included."""
        return cls(identity, query_len=target_len, seq_len=prefix_len + target_len, kv_start_pos=prefix_len)


@dataclass(frozen=True)
class PreparedBatch:
    """One forward's rows, bound to the row-table version they were prepared from, and their attention metadata."""

    table: WorkerRowTable
    table_version: int
    cache_role: str
    rows: tuple[BatchRow, ...]
    row_indices: Tensor  # int32 [R], the rows' indices in the table
    metadata: PagedAttentionMetadata

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
        write_kv_cache(k, v, kv_cache, self.metadata)
        return paged_attention(q, kv_cache, self.metadata, scale=scale).view(query.shape)

    def _tokens_heads_dim(self, layer: AttentionCacheSpec, name: str, x: Tensor) -> Tensor:
        """View `x` as `[num_tokens, heads, head_size]` without copying (strided views stay views)."""
        head_size = layer.head_size
        num_tokens, max_query_len = self.metadata.num_tokens, self.metadata.max_query_len
        uniform = num_tokens == len(self.rows) * max_query_len
        if x.dim() == 3 and x.shape[0] == num_tokens and x.shape[2] == head_size:
            return x
        if x.dim() == 2 and x.shape[0] == num_tokens and x.shape[1] % head_size == 0:
            return x.unflatten(1, (-1, head_size))
        if uniform and x.dim() in (3, 4) and tuple(x.shape[:2]) == (len(self.rows), max_query_len):
            tokens = x.flatten(0, 1)
            if tokens.dim() == 3 and tokens.shape[2] == head_size:
                return tokens
            if tokens.dim() == 2 and tokens.shape[1] % head_size == 0:
                return tokens.unflatten(1, (-1, head_size))
        layouts = f"[{num_tokens}, heads, {head_size}] or [{num_tokens}, heads*{head_size}]"
        if uniform:
            layouts += f" or [{len(self.rows)}, {max_query_len}, ...]"
        raise ValueError(f"layer {layer.layer_name!r}: {name} of shape {tuple(x.shape)} is not {layouts}")


def prepare_batch(
    table: WorkerRowTable, rows: Sequence[BatchRow], *, max_num_batched_tokens: int | None = None
) -> PreparedBatch:
    """Validate one forward's rows against the installed table and build their attention metadata.

    The block tables are gathered from the table's own device tensor (`WorkerRowTable.block_tables`),
    and the slot mapping is computed from them on that device.
    """
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
    for row, entry in zip(rows, installed, strict=True):
        if row.seq_len > entry.num_tokens:
            raise ValueError(
                f"row {row.identity}: seq_len={row.seq_len} is beyond its installed length of {entry.num_tokens} tokens"
            )
    row_indices = torch.tensor([entry.index for entry in installed], dtype=torch.int32, device=table.device)
    has_causal = any(row.causal_prefix_len is not None for row in rows)
    metadata = PagedAttentionMetadata.build(
        table.block_tables.index_select(0, row_indices),
        block_size=table.block_size,
        query_lens=[row.query_len for row in rows],
        seq_lens=[row.seq_len for row in rows],
        query_pos_start=[row.kv_start_pos for row in rows],
        causal_prefix_lens=[row.causal_prefix_len or 0 for row in rows] if has_causal else None,
    )
    return PreparedBatch(table, table.version, roles[0], tuple(rows), row_indices, metadata)
