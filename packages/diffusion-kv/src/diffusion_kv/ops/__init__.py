"""Paged K/V ops: write K/V through a slot mapping, and paged attention over block tables.

Layout (one tensor per cache-enabled layer or role): `kv_cache[num_blocks, 2, block_size,
num_kv_heads, head_size]`, index 0 = K, 1 = V, `num_blocks` the outer stride. Token
position `pos` of a row lives in slot `block_ids[pos // block_size] * block_size + pos % block_size`.

Both ops take one `PagedAttentionMetadata`: the forward's block tables, ragged query offsets,
key lengths, query positions, causal prefix lengths and slot mapping, built once per forward
(`diffusion_kv.prepare_batch` or `PagedAttentionMetadata.build`) and shared by every layer.

Dispatch: `backend="auto"` on CUDA tensors, for rows of at least `SDPA_GATHER_MIN_QUERY_LEN` queries,
runs cuDNN's own paged SDPA (`cudnn_paged`: the pages read in place, no copy; needs the optional
`nvidia-cudnn-frontend`) when no row attends to more than `CUDNN_PAGED_MAX_SEQ_LEN` keys, and
`sdpa_gather` (the rows' pages gathered into contiguous K/V, then torch's SDPA, which picks cuDNN on
Hopper) for longer rows, where cuDNN's dense kernel outruns its paged one by more than the gather
costs (H200, 2026-12-01: paged 0.90-0.92x dense, gather + dense 0.91-0.98x). Whichever of the two
declines the call, the other is tried, then the Triton kernels; elsewhere the torch reference path.
`"torch"`, `"triton"`, `"sdpa"` and `"cudnn"` force one (`"triton"` on CPU tensors needs
`TRITON_INTERPRET=1` set before `diffusion_kv.ops.triton_kernels` is first imported; `"sdpa"` and
`"cudnn"` raise if the call is unsupported).
Attention has two Triton kernels: `triton_flash` (TMA tile loads, Hopper and later, fp16/bf16,
head size 64 or 128, pages a multiple of 64 tokens, a contiguous cache) wherever
`triton_flash.supported` accepts the call, and the generic `triton_kernels` everywhere else.
Optional FP8 attention (e4m3 Q/K/V with per-head scales) lives in `diffusion_kv.ops.fp8_attention`.
Validation: see `diffusion_kv.ops.checks`.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from torch import Tensor

from diffusion_kv.ops import checks, reference
from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata

Backend = Literal["auto", "torch", "triton", "sdpa", "cudnn"]
_BACKENDS = ("auto", "torch", "triton", "sdpa", "cudnn")
_ATTENTION_ONLY = ("sdpa", "cudnn")
# Below this many queries per row "auto" keeps the Triton kernels (the library calls' fixed costs are not paid back).
SDPA_GATHER_MIN_QUERY_LEN = 512
# Up to this many keys per row "auto" prefers cuDNN's paged kernel; above it, gather + dense SDPA.
CUDNN_PAGED_MAX_SEQ_LEN = 4096


def _use_triton(backend: str, device_type: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend in _ATTENTION_ONLY:
        raise ValueError(
            f"backend={backend!r} is an attention backend only; write_kv_cache takes 'auto', 'torch' or 'triton'"
        )
    if backend == "torch":
        return False
    if backend == "triton":
        if device_type != "cuda" and not triton_interpreter_active():
            raise ValueError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before diffusion_kv.ops.triton_kernels is imported, or use backend='torch'"
            )
        return True
    return device_type == "cuda"


def triton_interpreter_active() -> bool:
    """True when the Triton kernels were (or will be) built for the CPU interpreter."""
    module = sys.modules.get("diffusion_kv.ops.triton_kernels")
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def write_kv_cache(
    key: Tensor, value: Tensor, kv_cache: Tensor, metadata: PagedAttentionMetadata, *, backend: Backend = "auto"
) -> None:
    """Write the K/V of the forward's `metadata.num_tokens` tokens into their slots of a paged cache.

    key/value: `[num_tokens, num_kv_heads, head_size]` in the cache dtype; they may be
    non-contiguous views of a packed QKV tensor (any strides; no copy is made).
    Only the slots of `metadata.slot_mapping` change.
    """
    checks.check_write_inputs(key, value, kv_cache, metadata)
    if key.shape[0] == 0:
        return
    if _use_triton(backend, kv_cache.device.type):
        from diffusion_kv.ops import triton_kernels

        triton_kernels.write_kv_cache(key, value, kv_cache, metadata)
    else:
        reference.write_kv_cache(key, value, kv_cache, metadata)


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    metadata: PagedAttentionMetadata,
    *,
    scale: float | None = None,
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Attention of the forward's ragged rows over keys read through each row's block table.

    query: `[num_tokens, num_heads, head_size]`, num_heads a multiple of the cache's num_kv_heads
    (GQA: query head h reads kv head `h // (num_heads // num_kv_heads)`). Non-causal, except that
    queries before a row's `causal_prefix_lens` entry attend causally. `scale` defaults to
    `head_size ** -0.5`. Softmax runs in fp32. Returns `[num_tokens, num_heads, head_size]` in the
    query dtype, written into `out` when given.
    """
    checks.check_attention_inputs(query, kv_cache, metadata, out)
    if scale is None:
        scale = query.shape[2] ** -0.5
    if query.shape[0] == 0:
        return out if out is not None else query.new_empty(query.shape)
    # The library paths take `out=None` and may then hand back their own result (gather + SDPA: SDPA's output
    # itself, with no copy); the kernels below write into an `out` allocated here.
    if backend in _ATTENTION_ONLY:
        library = _library_path(backend)
        reason = library.unsupported_reason(query, kv_cache, metadata)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {reason}; use backend='auto'")
        return library.paged_attention(query, kv_cache, metadata, scale, out)
    if backend == "auto" and query.is_cuda and metadata.max_query_len >= SDPA_GATHER_MIN_QUERY_LEN:
        for library in _library_order(metadata):
            if library.unsupported_reason(query, kv_cache, metadata) is None:
                return library.paged_attention(query, kv_cache, metadata, scale, out)
    if out is None:
        out = query.new_empty(query.shape)
    if _use_triton(backend, query.device.type):
        from diffusion_kv.ops import triton_flash, triton_kernels

        if triton_flash.supported(query, kv_cache) is None:
            return triton_flash.paged_attention(query, kv_cache, metadata, scale, out)
        return triton_kernels.paged_attention(query, kv_cache, metadata, scale, out)
    return reference.paged_attention(query, kv_cache, metadata, scale, out)


def _library_path(backend: str):
    if backend == "cudnn":
        from diffusion_kv.ops import cudnn_paged

        return cudnn_paged
    from diffusion_kv.ops import sdpa_gather

    return sdpa_gather


def _library_order(metadata: PagedAttentionMetadata) -> tuple:
    """The library paths "auto" tries, best first for the forward's longest row (see the module docstring)."""
    if (metadata.host_max_seq_len or 0) <= CUDNN_PAGED_MAX_SEQ_LEN:
        return _library_path("cudnn"), _library_path("sdpa")
    return _library_path("sdpa"), _library_path("cudnn")


__all__ = [
    "CUDNN_PAGED_MAX_SEQ_LEN",
    "SDPA_GATHER_MIN_QUERY_LEN",
    "Backend",
    "PagedAttentionMetadata",
    "paged_attention",
    "triton_interpreter_active",
    "write_kv_cache",
]
