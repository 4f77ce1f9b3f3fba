"""The one argument that tells the paged K/V ops where a forward's tokens live and what they attend to.

A forward runs a ragged batch of R rows. Row r contributes `query_len[r]` tokens at positions
`query_pos_start[r] .. query_pos_start[r] + query_len[r] - 1`; their K/V are written into the row's
pages, and each of them attends to the row's keys `0 .. seq_lens[r] - 1`, read through the row's
block table. `PagedAttentionMetadata` holds exactly that, as device tensors, built once per forward
and shared by every layer of it (as vLLM builds one attention-metadata object per step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from diffusion_kv._validation import check_positive_int, is_int


class HostRow(NamedTuple):
    """One row's shape as host ints (what `PagedAttentionMetadata.build` was given), for launch decisions."""

    query_start: int
    query_len: int
    seq_len: int
    query_pos_start: int
    causal_prefix_len: int


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Index tensors of one forward's ragged batch of R rows, all on one device.

    - `block_tables`: int32 `[R, W]`, row r's block ids in logical order (entries past the row's
      `ceil(seq_lens[r] / block_size)` blocks are never read);
    - `query_start_loc`: int32 `[R + 1]`, row r's tokens are `query_start_loc[r] : query_start_loc[r + 1]`
      of the packed token axis;
    - `seq_lens`: int32 `[R]`, row r attends to keys at positions `0 .. seq_lens[r] - 1`;
    - `query_pos_start`: int32 `[R]`, token i of row r sits at position `query_pos_start[r] + i`;
    - `slot_mapping`: int64 `[num_tokens]`, each token's cache slot,
      `block_tables[r, pos // block_size] * block_size + pos % block_size` (a negative slot skips
      the token's write);
    - `causal_prefix_lens`: int32 `[R]` or None; a query at position `p < causal_prefix_lens[r]`
      attends only to keys `j <= p`, later queries to every key;
    - `block_size`: the page size the slots were computed for; `num_tokens` and `max_query_len`
      are host copies, so a launch never reads a device tensor back;
    - `host_rows`: every row's shape as host ints (`HostRow`), set by `build`; None when the
      metadata was constructed directly (backends that need it then decline the call);
      `host_max_seq_len` and `queries_inside_causal_prefix` are derived from it once per metadata
      (cached), so the forward's layers do not re-walk the rows.

    `build` is the constructor: it checks every row's values on the host. The plain constructor
    checks types, shapes and devices only, and trusts the values.
    """

    block_tables: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    query_pos_start: Tensor
    slot_mapping: Tensor
    causal_prefix_lens: Tensor | None
    block_size: int
    num_tokens: int
    max_query_len: int
    host_rows: tuple[HostRow, ...] | None = None

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        for name in ("num_tokens", "max_query_len"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.block_tables.dim() != 2:
            raise ValueError(
                f"block_tables must have shape [num_rows, max_blocks_per_row], got {tuple(self.block_tables.shape)}"
            )
        num_rows = self.block_tables.shape[0]
        device = self.block_tables.device
        named = [
            ("block_tables", self.block_tables, torch.int32, None),
            ("query_start_loc", self.query_start_loc, torch.int32, (num_rows + 1,)),
            ("seq_lens", self.seq_lens, torch.int32, (num_rows,)),
            ("query_pos_start", self.query_pos_start, torch.int32, (num_rows,)),
            ("slot_mapping", self.slot_mapping, torch.int64, (self.num_tokens,)),
        ]
        if self.causal_prefix_lens is not None:
            named.append(("causal_prefix_lens", self.causal_prefix_lens, torch.int32, (num_rows,)))
        for name, tensor, dtype, shape in named:
            if tensor.dtype != dtype:
                raise ValueError(f"{name} must be a {dtype} tensor, got {tensor.dtype}")
            if shape is not None and tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)} for {num_rows} rows, got {tuple(tensor.shape)}")
            if tensor.device != device:
                raise ValueError(f"{name} is on {tensor.device} but block_tables is on {device}")
            if tensor.numel() and tensor.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dim (the kernels index it densely)")
        if self.host_rows is not None and len(self.host_rows) != num_rows:
            raise ValueError(f"host_rows has {len(self.host_rows)} entries for {num_rows} block-table rows")

    @functools.cached_property
    def host_max_seq_len(self) -> int | None:
        """The longest row's key count, from `host_rows` (None without them); computed once per metadata."""
        if self.host_rows is None:
            return None
        return max((row.seq_len for row in self.host_rows), default=0)

    @functools.cached_property
    def queries_inside_causal_prefix(self) -> bool | None:
        """Whether any query sits inside its row's causal prefix (None without `host_rows`); computed once."""
        if self.host_rows is None:
            return None
        return any(row.query_len and row.query_pos_start < row.causal_prefix_len for row in self.host_rows)

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]

    @property
    def device(self) -> torch.device:
        return self.block_tables.device

    @classmethod
    def build(
        cls,
        block_tables: Tensor,
        *,
        block_size: int,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        query_pos_start: Sequence[int],
        causal_prefix_lens: Sequence[int] | None = None,
    ) -> PagedAttentionMetadata:
        """Metadata of rows whose block tables are `block_tables` (int32 `[R, W]`, on the target device).

        Per-row values are host ints, checked here; the slot mapping is computed on the block
        tables' device from those tables, so no block id travels back to the host.
        """
        check_positive_int("block_size", block_size)
        if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
            raise ValueError(
                f"block_tables must be an int32 [num_rows, max_blocks_per_row] tensor, got "
                f"{block_tables.dtype} of shape {tuple(block_tables.shape)}"
            )
        num_rows, width = block_tables.shape
        columns = {"query_lens": query_lens, "seq_lens": seq_lens, "query_pos_start": query_pos_start}
        if causal_prefix_lens is not None:
            columns["causal_prefix_lens"] = causal_prefix_lens
        for name, values in columns.items():
            if len(values) != num_rows:
                raise ValueError(f"{name} must have {num_rows} entries (one per block-table row), got {len(values)}")
            if not all(is_int(value) and value >= 0 for value in values):
                raise ValueError(f"{name} must hold ints >= 0, got {list(values)}")
        capacity = width * block_size
        for row, (num_queries, seq_len, start) in enumerate(zip(query_lens, seq_lens, query_pos_start, strict=True)):
            if start + num_queries > seq_len:
                raise ValueError(
                    f"row {row}: queries at positions {start}..{start + num_queries - 1} lie beyond "
                    f"seq_len={seq_len}; a row's keys must include every query position"
                )
            if seq_len > capacity:
                raise ValueError(
                    f"row {row}: seq_len={seq_len} exceeds the block table width "
                    f"({width} blocks x {block_size} = {capacity} tokens)"
                )
        starts = [0]
        for num_queries in query_lens:
            starts.append(starts[-1] + num_queries)
        num_tokens = starts[-1]
        # One host-to-device copy carries every per-row vector; the fields are views of it.
        host = starts + list(seq_lens) + list(query_pos_start) + list(causal_prefix_lens or ())
        packed = torch.tensor(host, dtype=torch.int32).to(block_tables.device)
        r = num_rows
        query_start_loc = packed[: r + 1]
        seq_lens_t = packed[r + 1 : 2 * r + 1]
        pos_start_t = packed[2 * r + 1 : 3 * r + 1]
        causal = packed[3 * r + 1 :] if causal_prefix_lens is not None else None
        return cls(
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            query_pos_start=pos_start_t,
            slot_mapping=_slot_mapping(block_tables, query_start_loc, pos_start_t, block_size, num_tokens),
            causal_prefix_lens=causal,
            block_size=block_size,
            num_tokens=num_tokens,
            max_query_len=max(query_lens, default=0),
            host_rows=tuple(
                HostRow(int(start), int(n), int(seq), int(pos), int(prefix))
                for start, n, seq, pos, prefix in zip(
                    starts[:-1],
                    query_lens,
                    seq_lens,
                    query_pos_start,
                    causal_prefix_lens or [0] * num_rows,
                    strict=True,
                )
            ),
        )


def _slot_mapping(
    block_tables: Tensor, query_start_loc: Tensor, query_pos_start: Tensor, block_size: int, num_tokens: int
) -> Tensor:
    """Each token's slot, computed on the tables' device (no host sync: `output_size` is known)."""
    device = block_tables.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    rows = torch.repeat_interleave(
        torch.arange(block_tables.shape[0], device=device), query_lens, output_size=num_tokens
    )
    positions = (torch.arange(num_tokens, device=device) - query_start_loc[rows] + query_pos_start[rows]).long()
    blocks = block_tables[rows, torch.div(positions, block_size, rounding_mode="floor")].long()
    return blocks * block_size + positions % block_size


def unmasked_rows_reason(metadata: PagedAttentionMetadata) -> str | None:
    """Why a path that needs host row shapes and has no causal-prefix mask cannot run the forward (None: it can).

    The library paths (gather + SDPA, cuDNN paged) decide on host ints and attend every query to all of its
    row's keys, so they decline metadata without `host_rows` and any query inside its row's causal prefix.
    """
    if metadata.host_rows is None:
        return "the metadata has no host row shapes (build it with PagedAttentionMetadata.build)"
    if metadata.queries_inside_causal_prefix:
        return "a query lies inside its row's causal prefix"
    return None


__all__ = ["HostRow", "PagedAttentionMetadata", "unmasked_rows_reason"]
