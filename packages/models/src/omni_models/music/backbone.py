"""The music family's networks in plain torch: the Qwen3 backbone (training and reference), the depth decoder
(codebooks 1..7) and the codebook embeddings that compose a frame's feedback embedding.

The backbone's parameter names are Hugging Face Qwen3's (``model.layers.N.self_attn.q_proj.weight``, ...), so
the weights trained here load unchanged into the vLLM-registered model (``omni_models.music._vllm``), whose
layers are vLLM's own Qwen3 layers. ``depth.*`` and ``codebook_embed.*`` are shared modules: the same classes
run inside the vLLM model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_models.music.config import NUM_CODEBOOKS, MusicConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Neox-style rotary embedding over the last dim of ``x`` [B, S, H, D] at ``positions`` [B, S]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * freqs  # [B, S, half]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        c = self.c
        q = rope(self.q_norm(self.q_proj(x).view(b, s, c.num_heads, c.head_dim)), positions, c.rope_theta)
        k = rope(self.k_norm(self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim)), positions, c.rope_theta)
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CodebookEmbedding(nn.Module):
    """Embeddings of codebooks 1..7; a frame's feedback embedding adds them to its c0 token's embedding."""

    def __init__(self, c: MusicConfig, width: int) -> None:
        super().__init__()
        self.tables = nn.Parameter(torch.zeros(NUM_CODEBOOKS - 1, c.codebook_size, width))
        nn.init.normal_(self.tables, std=0.02)

    def forward(self, codes: Tensor) -> Tensor:
        """``codes`` [..., 7] -> summed embedding [..., width]."""
        index = torch.arange(NUM_CODEBOOKS - 1, device=codes.device)
        return self.tables[index, codes].sum(-2)


class DepthDecoder(nn.Module):
    """Fills codebooks 1..7 of a frame from the backbone hidden state and c0, one codebook at a time.

    Position 0 reads ``proj(hidden) + c0_embed(c0)`` and predicts c1; position k reads ``code_embed(c_k)`` and
    predicts c_{k+1}; causal self-attention over the frame's positions.
    """

    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.c = c
        w = c.depth_hidden_size
        self.proj = nn.Linear(c.hidden_size, w)
        self.c0_embed = nn.Embedding(c.c0_vocab_size, w)
        self.code_embed = CodebookEmbedding(c, w)
        self.position = nn.Parameter(torch.zeros(NUM_CODEBOOKS - 1, w))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(w, c.depth_heads, 4 * w, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(c.depth_layers)
        )
        self.norm = nn.LayerNorm(w)
        self.heads = nn.Parameter(torch.zeros(NUM_CODEBOOKS - 1, w, c.codebook_size))
        nn.init.normal_(self.heads, std=0.02)

    def inputs(self, hidden: Tensor, c0: Tensor, codes: Tensor) -> Tensor:
        """Inputs [N, 1 + k, w] for hidden [N, H], c0 [N] (code index) and the first k codes ``codes`` [N, k]."""
        first = self.proj(hidden) + self.c0_embed(c0)
        rest = [self.code_embed.tables[j, codes[:, j]] for j in range(codes.shape[1])]
        x = torch.stack([first, *rest], dim=1)
        return x + self.position[: x.shape[1]]

    def logits(self, hidden: Tensor, c0: Tensor, codes: Tensor) -> Tensor:
        """Logits [N, 1 + k, codebook_size]: position j predicts codebook j + 1."""
        x = self.inputs(hidden, c0, codes)
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
        for layer in self.layers:
            x = layer(x, src_mask=mask)
        x = self.norm(x)
        return torch.einsum("npw,pwc->npc", x, self.heads[:n])


class MusicBackbone(nn.Module):
    """Plain-torch Qwen3 backbone with the music heads: training and the CPU/GPU reference path."""

    def __init__(self, c: MusicConfig) -> None:
        super().__init__()
        self.config = c
        self.model = Qwen3Body(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.codebook_embed = CodebookEmbedding(c, c.hidden_size)
        self.depth = DepthDecoder(c)

    def embed(self, token_ids: Tensor, frame_codes: Tensor | None = None) -> Tensor:
        """Input embeddings [B, S, H]; ``frame_codes`` [B, S, 7] (-1 = none) adds each fed-back frame's codes."""
        x = self.model.embed_tokens(token_ids)
        if frame_codes is not None:
            has = (frame_codes[..., 0] >= 0)[..., None]
            x = x + torch.where(has, self.codebook_embed(frame_codes.clamp(min=0)), torch.zeros_like(x))
        return x

    def hidden(self, embeds: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        """Final hidden states [B, S, H] (causal; ``pad_mask`` [B, S] True at real tokens, left padding)."""
        b, s, _ = embeds.shape
        positions = torch.arange(s, device=embeds.device).expand(b, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=embeds.device).tril()
        if pad_mask is not None:
            positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)
            mask = mask[None, None] & pad_mask[:, None, None, :]
            mask = mask | torch.eye(s, dtype=torch.bool, device=embeds.device)  # padded queries see themselves
        x = embeds
        for layer in self.model.layers:
            x = layer(x, positions, mask)
        return self.model.norm(x)
