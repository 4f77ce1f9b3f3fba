"""Optional FP8 paged attention: ``float8_e4m3fn`` queries and K/V with one float32 scale per head.

Layout of an FP8 cache: ``[num_blocks, 2, page, num_kv_heads, head_size]`` like the bf16 one, except that the V
half of every block holds that page's values transposed, ``[num_kv_heads, head_size, page]`` (FP8 tensor cores
read both operands of ``P @ V`` along the key axis). ``write_kv_cache_fp8`` writes it; nothing else should.

Numerics: ``k8 = fp8(clamp(k / k_scale[h]))`` (likewise v, q); scores are ``(q8 . k8) * q_scale * k_scale``,
softmax in fp32, the probabilities rounded to e4m3 for the second product, whose fp32 result is scaled by
``v_scale``. Attention is non-causal (every query of a row sees all of its keys); ragged rows and GQA as in
``diffusion_kv.ops.paged_attention``; both ops take the forward's ``PagedAttentionMetadata``.

Backends: ``"auto"`` runs the Triton kernel on CUDA (compute capability 9.0+, page a multiple of 64, head size
64 or 128) and the torch reference elsewhere; the reference dequantizes and runs the fp32 reference attention
(it does not round the probabilities, so the kernel differs from it by about one e4m3 step of P).
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffusion_kv.ops import reference
from diffusion_kv.ops.attention_metadata import PagedAttentionMetadata

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_BACKENDS = ("auto", "torch", "triton")


def per_head_scales(x: Tensor) -> Tensor:
    """float32 ``[heads]`` scales of ``x [tokens, heads, head_size]``: ``max(amax / 448, MIN_SCALE)`` per head."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [tokens, heads, head_size] tensor, got {x.dtype} {tuple(x.shape)}")
    amax = x.abs().amax(dim=(0, 2)).float() if x.shape[0] else torch.zeros(x.shape[1], device=x.device)
    return torch.clamp(amax / FP8_MAX, min=MIN_SCALE)


def quantize_per_head(x: Tensor, scale: Tensor) -> Tensor:
    """``fp8(clamp(x / scale[h]))`` of ``x [tokens, heads, head_size]`` (float32 arithmetic)."""
    return (x.float() / scale.view(1, -1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_cache(kv_cache: Tensor, metadata: PagedAttentionMetadata) -> tuple[int, int]:
    """Check an FP8 cache against the forward's metadata; return ``(num_kv_heads, head_size)``."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.dtype != FP8_DTYPE:
        raise ValueError(
            f"kv_cache must be a {FP8_DTYPE} [num_blocks, 2, page, num_kv_heads, head_size] tensor, got "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("the FP8 kv_cache must be contiguous (its V half is addressed as transposed pages)")
    if kv_cache.shape[2] != metadata.block_size:
        raise ValueError(
            f"kv_cache has blocks of {kv_cache.shape[2]} tokens but the metadata was built for "
            f"block_size={metadata.block_size}"
        )
    if metadata.device != kv_cache.device:
        raise ValueError(f"the attention metadata is on {metadata.device} but kv_cache is on {kv_cache.device}")
    return kv_cache.shape[3], kv_cache.shape[4]


def _check_scales(name: str, scale: Tensor, heads: int, device: torch.device) -> None:
    if scale.shape != (heads,) or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(
            f"{name} must be a float32 [{heads}] tensor on {device}, got {scale.dtype} "
            f"{tuple(scale.shape)} on {scale.device}"
        )


def _kernels_apply(backend: str, device: torch.device) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    from diffusion_kv.ops import triton_interpreter_active

    runnable = device.type == "cuda" or triton_interpreter_active()
    if backend == "triton" and not runnable:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (see diffusion_kv.ops)")
    return backend != "torch" and runnable


def write_kv_cache_fp8(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    metadata: PagedAttentionMetadata,
    k_scale: Tensor,
    v_scale: Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Quantize ``key``/``value [num_tokens, num_kv_heads, head_size]`` per head into their slots
    (``metadata.slot_mapping``; a negative slot skips its token)."""
    num_kv_heads, head_size = _check_cache(kv_cache, metadata)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size) or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_size}] with stride(-1) == 1, got {tuple(t.shape)}"
            )
        if t.shape[0] != metadata.num_tokens or t.device != kv_cache.device:
            raise ValueError(f"{name} must hold the metadata's {metadata.num_tokens} tokens on {kv_cache.device}")
    _check_scales("k_scale", k_scale, num_kv_heads, kv_cache.device)
    _check_scales("v_scale", v_scale, num_kv_heads, kv_cache.device)
    page = kv_cache.shape[2]
    if metadata.device.type == "cpu" and metadata.num_tokens:
        if int(metadata.slot_mapping.max()) >= kv_cache.shape[0] * page:
            raise ValueError(f"slot_mapping holds slot {int(metadata.slot_mapping.max())}, beyond the pool")
    if key.shape[0] == 0:
        return
    if _kernels_apply(backend, kv_cache.device):
        from diffusion_kv.ops import triton_flash

        triton_flash.write_kv_cache_fp8(key, value, kv_cache, metadata, k_scale, v_scale, FP8_MAX)
        return
    slots = metadata.slot_mapping
    keep = slots >= 0
    blocks, offsets = slots[keep] // page, slots[keep] % page
    kv_cache[blocks, 0, offsets] = quantize_per_head(key[keep], k_scale)
    v_pages = kv_cache[:, 1].view(kv_cache.shape[0], num_kv_heads, head_size, page)
    v_pages[blocks, :, :, offsets] = quantize_per_head(value[keep], v_scale)


def dequantize_kv_cache_fp8(
    kv_cache: Tensor, k_scale: Tensor, v_scale: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The FP8 cache as an ordinary ``[num_blocks, 2, page, num_kv_heads, head_size]`` cache of ``dtype``."""
    if kv_cache.dim() != 5 or kv_cache.dtype != FP8_DTYPE:
        raise ValueError(f"kv_cache must be a {FP8_DTYPE} [num_blocks, 2, page, num_kv_heads, head_size] tensor")
    num_blocks, _, page, num_kv_heads, head_size = kv_cache.shape
    keys = kv_cache[:, 0].float() * k_scale.view(1, 1, -1, 1)
    values = kv_cache[:, 1].reshape(num_blocks, num_kv_heads, head_size, page).permute(0, 3, 1, 2).float()
    values = values * v_scale.view(1, 1, -1, 1)
    return torch.stack([keys, values], dim=1).to(dtype)


def paged_attention_fp8(
    query: Tensor,
    q_scale: Tensor,
    kv_cache: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    metadata: PagedAttentionMetadata,
    *,
    scale: float | None = None,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> Tensor:
    """Non-causal attention of FP8 queries ``[num_tokens, num_heads, head_size]`` over an FP8 paged cache.

    The metadata is the forward's, as for ``diffusion_kv.ops.paged_attention`` (without causal prefixes).
    Returns ``[num_tokens, num_heads, head_size]`` in ``out_dtype`` (or writes ``out``).
    """
    num_kv_heads, head_size = _check_cache(kv_cache, metadata)
    if query.dtype != FP8_DTYPE or query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(
            f"query must be {FP8_DTYPE} [num_tokens, num_heads, {head_size}], got {query.dtype} {tuple(query.shape)}"
        )
    if query.shape[0] != metadata.num_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens but the metadata describes {metadata.num_tokens}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if metadata.causal_prefix_lens is not None:
        raise ValueError("FP8 paged attention is non-causal: build the metadata without causal_prefix_lens")
    _check_scales("q_scale", q_scale, query.shape[1], query.device)
    _check_scales("k_scale", k_scale, num_kv_heads, query.device)
    _check_scales("v_scale", v_scale, num_kv_heads, query.device)
    if out is None:
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    elif out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with stride(-1) == 1, got {tuple(out.shape)}")
    if scale is None:
        scale = head_size**-0.5
    if query.shape[0] == 0:
        return out
    if _kernels_apply(backend, query.device):
        from diffusion_kv.ops import triton_flash

        reason = triton_flash.supported(query, kv_cache)
        if reason is None:
            return triton_flash.paged_attention_fp8(query, q_scale, kv_cache, k_scale, v_scale, metadata, scale, out)
        if backend == "triton":
            raise ValueError(f"the FP8 kernel cannot run this call: {reason}")
    dense = dequantize_kv_cache_fp8(kv_cache, k_scale, v_scale)
    q = query.float() * q_scale.view(1, -1, 1)
    result = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    reference.paged_attention(q, dense, metadata, scale, result)
    out.copy_(result)
    return out


__all__ = [
    "dequantize_kv_cache_fp8",
    "paged_attention_fp8",
    "per_head_scales",
    "quantize_per_head",
    "write_kv_cache_fp8",
]
