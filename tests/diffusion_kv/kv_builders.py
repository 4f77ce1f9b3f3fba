"""Builders shared by the diffusion_kv tests: pools, allocators and rows; paged K/V op inputs.

`conftest.py` puts this folder on `sys.path` (pytest runs with `--import-mode=importlib`),
so test modules import it as `kv_builders`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from diffusion_kv import (
    BlockAllocator,
    BlockPoolConfig,
    DiffusionKVRequest,
    PagedAttentionMetadata,
    _vllm,
    sequence_request_id,
    write_kv_cache,
)
from diffusion_kv.allocator import build_block_allocator

BLOCK_SIZE = 4


def native_kv_cache_config(
    num_blocks: int, block_size: int = BLOCK_SIZE, *, num_kv_heads: int = 2, dtype: torch.dtype = torch.bfloat16
):
    """A one-layer (`"attn"`) vLLM `KVCacheConfig` of non-causal full attention, head_size 8; skips without vLLM."""
    pytest.importorskip("vllm")
    return _vllm.make_full_attention_kv_cache_config(
        num_blocks, block_size, num_kv_heads=num_kv_heads, head_size=8, dtype=dtype, layer_names=("attn",)
    )


def pool_config(kind: str, num_blocks: int, **native: Any):
    """`BlockPoolConfig` for the builtin allocator, a vLLM `KVCacheConfig` (`native` kwargs) otherwise."""
    if kind == "builtin":
        return BlockPoolConfig(num_blocks, BLOCK_SIZE)
    return native_kv_cache_config(num_blocks, **native)


def build_allocator(kind: str, config: Any, *, max_model_len: int) -> BlockAllocator:
    """The `kind` allocator over `config`, with BLOCK_SIZE scheduler/hash blocks and no in-flight cap."""
    return build_block_allocator(
        config,
        allocator=kind,
        max_model_len=max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_in_flight_tokens=None,
    )


def cfg_rows(
    public_id: str, count: int, *, prefix_len: int, seq_len: int = 8, contexts=(), **extra: Any
) -> list[DiffusionKVRequest]:
    """`count` CFG rows of `public_id`, each `[prefix_len | seq_len - prefix_len]`."""
    return [
        DiffusionKVRequest(
            sequence_request_id(public_id, index),
            sequence_id=index,
            prefix_len=prefix_len,
            target_len=seq_len - prefix_len,
            seq_len=seq_len,
            kv_contexts=contexts,
            **extra,
        )
        for index in range(count)
    ]


@dataclass
class EngineRequest:
    """The engine-request surface the scheduler reads: an id and the rows it takes over."""

    request_id: str
    diffusion_kv_requests: Any
    prepared_layout: str = "layout"


class DelegatingAllocator:
    """Allocator wrapper that forwards everything to `inner`; subclasses override `allocate`."""

    def __init__(self, inner):
        self.inner = inner
        self.allocate_calls = 0

    num_groups = property(lambda self: self.inner.num_groups)
    empty_pool_free_blocks = property(lambda self: self.inner.empty_pool_free_blocks)

    def get_num_free_blocks(self):
        return self.inner.get_num_free_blocks()

    def blocks_for_full_reservation(self, num_tokens):
        return self.inner.blocks_for_full_reservation(num_tokens)

    def allocate(self, request):
        self.allocate_calls += 1
        return self.inner.allocate(request)

    def free(self, request):
        self.inner.free(request)

    def owned_request_ids(self):
        return self.inner.owned_request_ids()


# -- paged K/V op inputs --------------------------------------------------------------


def as_i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def packed_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, device, generator):
    """Q, K, V as views of one packed projection output (K/V non-contiguous, like a fused QKV linear)."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_size),
        k.view(num_tokens, num_kv_heads, head_size),
        v.view(num_tokens, num_kv_heads, head_size),
    )


def sdpa_row(q, k, v, mask=None, scale=None):
    """SDPA over one row in fp32: q [q, H, D], k/v [S, Hkv, D]; GQA by repeating kv heads."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(group, 1).transpose(0, 1).float(),
        v.repeat_interleave(group, 1).transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def row_metadata(block_tables, rows, page_size, device, causal_prefix_lens=None) -> PagedAttentionMetadata:
    """Metadata of rows given as `(query_pos_start, num_queries)`, each attending up to its last query."""
    return PagedAttentionMetadata.build(
        as_i32(block_tables, device),
        block_size=page_size,
        query_lens=[n for _, n in rows],
        seq_lens=[start + n for start, n in rows],
        query_pos_start=[start for start, _ in rows],
        causal_prefix_lens=causal_prefix_lens,
    )


def build_paged_rows(
    rows,
    num_heads,
    num_kv_heads,
    head_size,
    page_size,
    dtype,
    seed,
    *,
    device,
    backend,
    spare_blocks=2,
    pad_block=None,
    causal_prefix_lens=None,
):
    """Random packed-QKV rows written into a shuffled pool; returns the op arguments and dense K/V per row.

    `rows` holds `(query_pos_start, num_queries)`; a row's seq_len is their sum. The pool has
    `spare_blocks` blocks beyond the rows' own; block tables are padded with `pad_block`
    (default: the last spare block, which no row owns). The arguments are
    `(query, kv_cache, metadata)` for the queries of every row.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [start + n for start, n in rows]
    blocks = [-(-s // page_size) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + spare_blocks, generator=gen).tolist()
    pad = perm[-1] if pad_block is None else pad_block
    kv_cache = torch.zeros(len(perm), 2, page_size, num_kv_heads, head_size, dtype=dtype, device=device)
    width = max(blocks) + 1
    tables, queries, dense, cursor = [], [], [], 0
    for (start, _n), seq_len, nb in zip(rows, seq_lens, blocks, strict=True):
        ids = perm[cursor : cursor + nb]
        cursor += nb
        tables.append(ids + [pad] * (width - nb))
        q, k, v = packed_qkv(seq_len, num_heads, num_kv_heads, head_size, dtype, device, gen)
        # The whole row's K/V first (a forward over positions 0..seq_len-1), then the queries attend.
        write_kv_cache(k, v, kv_cache, row_metadata([tables[-1]], [(0, seq_len)], page_size, device), backend=backend)
        queries.append(q[start:])
        dense.append((k, v))
    metadata = row_metadata(tables, rows, page_size, device, causal_prefix_lens)
    return (torch.cat(queries), kv_cache, metadata), queries, dense
