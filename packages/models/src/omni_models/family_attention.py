"""omni's attention processors for the diffusers families, installed with ``transformer.set_attn_processor``.

A processor is diffusers' public extension point for an attention layer: it receives the layer (its
projections and norms) and the hidden states, and returns the layer's outputs. These processors compute what
diffusers' own ``FluxAttnProcessor`` / ``QwenDoubleStreamAttnProcessor2_0`` compute, in the same order (so the
same numbers), and send the attention itself through ``omni_models.attention.attention``. The Qwen-Image one
also accepts ``text_lengths`` (through the transformer's ``attention_kwargs``), so rows whose prompts have
different lengths can share one forward: it then orders each row ``[image, text]`` so that the padding is the
row's tail, which the attention skips without copying Q, K or V (softmax over keys does not depend on their
order; RoPE was applied before).

Pure torch: the layer objects are diffusers modules, but nothing here imports diffusers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_models.attention import attention, row_lengths
from omni_models.registry import AttentionDtype, check_attention_dtype


def _heads(x: Tensor, head_dim: int) -> Tensor:
    return x.unflatten(-1, (-1, head_dim))


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """FLUX's rotary embedding on ``[B, S, H, D]``: pairs ``(x[2i], x[2i+1])`` rotate by the angles in cos/sin
    ``[S, D]``."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rotate_complex(x: Tensor, freqs: Tensor) -> Tensor:
    """Qwen-Image's rotary embedding on ``[B, S, H, D]`` with complex frequencies ``[S, D/2]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(1)).flatten(3).type_as(x)


class _OmniAttnProcessor:
    """What every omni processor holds: the dtype its attention runs in (``omni_models.attention``: "auto", or
    "fp8"), checked once when it is built."""

    def __init__(self, attention_dtype: AttentionDtype = "auto") -> None:
        check_attention_dtype(attention_dtype)
        self.attention_dtype = attention_dtype


class OmniFluxAttnProcessor(_OmniAttnProcessor):
    """For ``FluxAttention`` layers: double-stream blocks (text via the ``add_*`` projections) and single-stream ones.

    ``attend`` is the attention over ``[B, S, H, D]`` (``omni_models.family_parallel`` swaps in Ulysses), in
    ``attention_dtype`` (``omni_models.attention``: "auto", or "fp8").
    """

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return attention(query, key, value, dtype=self.attention_dtype)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if attention_mask is not None:
            raise ValueError("omni's FLUX attention takes no attention_mask: FLUX attends over every token")
        if getattr(attn, "fused_projections", False):
            raise ValueError(
                "omni's FLUX attention needs unfused projections; call transformer.unfuse_qkv_projections()"
            )
        head_dim = attn.head_dim
        query = attn.norm_q(_heads(attn.to_q(hidden_states), head_dim))
        key = attn.norm_k(_heads(attn.to_k(hidden_states), head_dim))
        value = _heads(attn.to_v(hidden_states), head_dim)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            text_query = attn.norm_added_q(_heads(attn.add_q_proj(encoder_hidden_states), head_dim))
            text_key = attn.norm_added_k(_heads(attn.add_k_proj(encoder_hidden_states), head_dim))
            text_value = _heads(attn.add_v_proj(encoder_hidden_states), head_dim)
            query = torch.cat([text_query, query], dim=1)
            key = torch.cat([text_key, key], dim=1)
            value = torch.cat([text_value, value], dim=1)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = rotate_interleaved(query, cos, sin), rotate_interleaved(key, cos, sin)
        out = self.attend(query, key, value).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class OmniQwenImageAttnProcessor(_OmniAttnProcessor):
    """For Qwen-Image's joint text+image ``Attention`` layers (order ``[text, image]``), in ``attention_dtype``."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        encoder_hidden_states_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
        text_lengths: Sequence[int] | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("Qwen-Image attention needs the text stream (encoder_hidden_states)")
        if attention_mask is not None or encoder_hidden_states_mask is not None:
            raise ValueError(
                "omni's Qwen-Image attention takes no masks: pass each row's prompt length as "
                "attention_kwargs={'text_lengths': [...]} instead (padding is then never attended to)"
            )
        head_dim = attn.inner_dim // attn.heads
        streams = []
        for x, to_q, to_k, to_v, norm_q, norm_k in (
            (
                encoder_hidden_states,
                attn.add_q_proj,
                attn.add_k_proj,
                attn.add_v_proj,
                attn.norm_added_q,
                attn.norm_added_k,
            ),
            (hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k),
        ):
            query, key, value = (_heads(proj(x), head_dim) for proj in (to_q, to_k, to_v))
            if norm_q is not None:
                query = norm_q(query)
            if norm_k is not None:
                key = norm_k(key)
            streams.append((query, key, value))
        (text_query, text_key, text_value), (image_query, image_key, image_value) = streams
        if image_rotary_emb is not None:
            image_freqs, text_freqs = image_rotary_emb
            image_query, image_key = rotate_complex(image_query, image_freqs), rotate_complex(image_key, image_freqs)
            text_query, text_key = rotate_complex(text_query, text_freqs), rotate_complex(text_key, text_freqs)
        text_out, image_out = joint_attention(
            (text_query, text_key, text_value),
            (image_query, image_key, image_value),
            text_lengths,
            self.attention_dtype,
        )
        image_out = attn.to_out[0](image_out.contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(text_out.contiguous())


@torch.compiler.disable
def joint_attention(
    text: tuple[Tensor, Tensor, Tensor],
    image: tuple[Tensor, Tensor, Tensor],
    text_lengths: Sequence[int] | Tensor | None,
    dtype: AttentionDtype = "auto",
) -> tuple[Tensor, Tensor]:
    """Qwen-Image's joint attention over ``(query, key, value)`` of the text and image streams: ``(text_out,
    image_out)``, flattened over heads. ``text_lengths``: each row's prompt length, ints or a CPU integer tensor.

    Kept out of ``torch.compile``'s graphs: the rows' prompt lengths are host integers that choose the attention's
    row groups, and a compiled graph would specialize on them (one recompile per combination of prompt lengths);
    passed as a CPU tensor they reach it without a guard on their values or count. The projections, norms and RoPE
    before it and everything after it stay compiled.
    """
    if isinstance(text_lengths, Tensor):
        text_lengths = text_lengths.tolist()
    (text_query, text_key, text_value), (image_query, image_key, image_value) = text, image
    text_len, image_len = text_query.shape[1], image_query.shape[1]
    if text_lengths is not None and not all(0 < n <= text_len for n in text_lengths):
        raise ValueError(f"text_lengths {list(text_lengths)} must each be in [1, {text_len}]")
    lengths = None if text_lengths is None else row_lengths([image_len + n for n in text_lengths], image_len + text_len)
    if lengths is None:  # diffusers' own order, [text, image]: the same numbers as its processor
        out = (
            attention(
                torch.cat([text_query, image_query], dim=1),
                torch.cat([text_key, image_key], dim=1),
                torch.cat([text_value, image_value], dim=1),
                dtype=dtype,
            )
            .flatten(2, 3)
            .to(text_query.dtype)
        )
        return _fresh(out[:, :text_len]), _fresh(out[:, text_len:])
    out = (
        attention(
            torch.cat([image_query, text_query], dim=1),
            torch.cat([image_key, text_key], dim=1),
            torch.cat([image_value, text_value], dim=1),
            lengths,
            dtype=dtype,
        )
        .flatten(2, 3)
        .to(text_query.dtype)
    )
    return _fresh(out[:, image_len:]), _fresh(out[:, :image_len])


def _fresh(x: Tensor) -> Tensor:
    """A contiguous tensor that is no view: what re-enters a compiled graph from ``joint_attention`` then carries
    no base tensor whose layout (one per attention path) the graph would guard on and recompile for."""
    return x.clone(memory_format=torch.contiguous_format)


def _rotate_wan(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Wan's RoPE on ``[B, S, H, D]``: interleaved pairs, diffusers' ``WanAttnProcessor`` arithmetic."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class OmniWanAttnProcessor(_OmniAttnProcessor):
    """For ``WanAttention`` layers: what diffusers' ``WanAttnProcessor`` computes, in its order. The self-attention
    over the video tokens (``attn1``, where the time goes) attends in ``attention_dtype`` (``attend``: Ulysses SP
    overrides it); the cross-attention over the text (and an I2V model's image context) stays on the default path:
    its keys are a few hundred tokens."""

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The self-attention of ``[B, S, H, D]`` queries, keys and values."""
        return attention(query, key, value, dtype=self.attention_dtype)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        if attention_mask is not None:
            raise ValueError("omni's Wan attention takes no attention_mask: Wan attends over every token")
        if getattr(attn, "fused_projections", False):
            raise ValueError(
                "omni's Wan attention needs unfused projections; call transformer.unfuse_qkv_projections()"
            )
        image_context = None
        if attn.add_k_proj is not None:  # I2V: the image context leads, then the 512 text tokens (diffusers' split)
            split = encoder_hidden_states.shape[1] - 512
            image_context, encoder_hidden_states = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(context).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotate_wan(query, *rotary_emb), _rotate_wan(key, *rotary_emb)
        image_out = None
        if image_context is not None:
            image_key = attn.norm_added_k(attn.add_k_proj(image_context)).unflatten(2, (attn.heads, -1))
            image_value = attn.add_v_proj(image_context).unflatten(2, (attn.heads, -1))
            image_out = _cross_attention(query, image_key, image_value).flatten(2, 3).type_as(query)
        out = self.attend(query, key, value) if encoder_hidden_states is None else _cross_attention(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        return attn.to_out[1](attn.to_out[0](out))


def _cross_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Unmasked SDPA of ``[B, Sq, H, D]`` queries over ``[B, Sk, H, D]`` keys (diffusers' native backend layout)."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out.transpose(1, 2)
