"""The causal-prefix DiT: prompt tokens are a causal prefix, image patches are the timestep-modulated target.

One joint sequence ``[prefix | target]`` per row. Prefix (text) queries attend causally to prefix keys only and
never see the timestep; target (image) queries attend to every prefix key and every target key, and only target
tokens get adaLN-zero modulation from the timestep. Hence a row's prefix K/V in every layer depend only on its
prompt: they are computed once per request and reused, exactly, by every denoising step.

Blocks are layout-agnostic: token tensors are either batched ``[B, L, width]`` or flat ``[tokens, width]``
(ragged rows, as the paged runner uses). The attention itself is injected as an ``attend`` callable, so the same
block weights serve the dense reference path (SDPA with the causal-prefix mask) and the paged path
(``diffusion_kv``); each block's ``forward`` is the only entry point, so module hooks (offload) see every call.

In the flat layout every target token names its request row (``target_row_ids``), and the adaLN modulation,
gated residuals and norms run as the fused, indexed ops of ``omni_models.fused`` (Triton on CUDA, the torch
reference elsewhere); when a consuming linear is an ``fp8_cache.FP8Linear``, the op before it writes FP8.
``CausalPrefixDiT.set_fused_ops(False)`` selects the unfused torch sequence instead (gather every token's
modulation rows, then separate norm, scale, shift and gate ops), the reference these ops are measured against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_models import fused
from omni_models.config import DiTConfig
from omni_models.tokenizer import PAD_ID


class QKV(NamedTuple):
    """One side's (prefix or target) queries, keys and values, each ``[..., heads, head_size]``."""

    query: Tensor
    key: Tensor
    value: Tensor


class AttendFn(Protocol):
    """The attention op a block runs: ``attend(attention, prefix, target) -> (out_prefix, out_target)``.

    ``attention`` is the calling layer (its ``layer_index`` picks the cache, if any). Outputs have their query's
    shape; a side that is absent in this call (None) is None on output too.
    """

    def __call__(
        self, attention: JointAttention, prefix: QKV | None, target: QKV | None
    ) -> tuple[Tensor | None, Tensor | None]: ...


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and returned in the input's dtype (works for any weight/input dtype mix)."""

    fused_ops = True  # one kernel per [tokens, heads, size] call on CUDA (omni_models.fused.rms_norm)

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, eps=self.eps, backend="auto" if self.fused_ops else "torch")


class JointAttention(nn.Module):
    """QKV projection with per-head RMS QK-norm, and the output projection; the attention op is injected."""

    def __init__(self, width: int, num_heads: int, layer_index: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = width // num_heads
        self.layer_index = layer_index
        self.qkv = nn.Linear(width, 3 * width)
        self.q_norm = RMSNorm(self.head_size)
        self.k_norm = RMSNorm(self.head_size)
        self.proj = nn.Linear(width, width)

    def project(self, x: Tensor | fused.FP8Activation) -> QKV:
        """q, k (RMS-normed) and v; ``x`` may be an FP8 activation when ``qkv`` is an FP8 linear."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_size)).unbind(-3)
        return QKV(self.q_norm(q), self.k_norm(k), v)


class MLP(nn.Module):
    fused_ops = True  # with an FP8 fc2, GELU writes its FP8 input (omni_models.fused.gelu_quantize)

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor | fused.FP8Activation) -> Tensor:
        hidden = self.fc1(x)
        if self.fused_ops and hidden.dim() == 2 and fused.wants_fp8_input(self.fc2, hidden):
            return self.fc2(fused.gelu_quantize(hidden))  # GELU writes FP8: no quantization pass of its own
        return self.fc2(F.gelu(hidden, approximate="tanh"))


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def _per_token(rows: Tensor, target_row_ids: Tensor | None) -> Tensor:
    """Per-row values [R, C] -> broadcastable against the target tokens (batched or flat layout)."""
    return rows.unsqueeze(1) if target_row_ids is None else rows.index_select(0, target_row_ids)


class CausalPrefixBlock(nn.Module):
    """Pre-norm transformer block shared by prefix and target tokens; adaLN-zero on target tokens only."""

    fused_ops = True  # flat layout: the indexed fused ops of omni_models.fused (else the unfused torch sequence)

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, layer_index: int) -> None:
        super().__init__()
        self.prefix_norm1 = nn.LayerNorm(width, eps=1e-6)
        self.prefix_norm2 = nn.LayerNorm(width, eps=1e-6)
        self.target_norm1 = nn.LayerNorm(width, eps=1e-6, elementwise_affine=False)
        self.target_norm2 = nn.LayerNorm(width, eps=1e-6, elementwise_affine=False)
        self.attn = JointAttention(width, num_heads, layer_index)
        self.mlp = MLP(width, int(width * mlp_ratio))
        self.modulation = nn.Linear(width, 6 * width)

    def forward(
        self,
        prefix: Tensor | None,
        target: Tensor | None,
        target_cond: Tensor | None,
        attend: AttendFn,
        target_row_ids: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        prefix_qkv = target_qkv = None
        if prefix is not None:
            prefix_qkv = self.attn.project(self.prefix_norm1(prefix))
        if target is not None:
            modulation = self.modulation(F.silu(target_cond))
            indexed = target_row_ids is not None and self.fused_ops
            if not indexed:  # per-token copies of the modulation rows, broadcast (batched) or gathered (flat)
                shift1, scale1, gate1, shift2, scale2, gate2 = _per_token(modulation, target_row_ids).chunk(6, dim=-1)
                hidden = _modulate(self.target_norm1(target), shift1, scale1)
            else:  # flat [tokens, width]: each token reads its request row's modulation by index
                shift1, scale1, gate1, shift2, scale2, gate2 = modulation.chunk(6, dim=-1)
                hidden = fused.layer_norm_modulate(
                    target,
                    shift1,
                    scale1,
                    target_row_ids,
                    eps=self.target_norm1.eps,
                    quantize=fused.wants_fp8_input(self.attn.qkv, target),
                )
            target_qkv = self.attn.project(hidden)
        out_p, out_t = attend(self.attn, prefix_qkv, target_qkv)
        if prefix is not None:
            prefix = prefix + self.attn.proj(out_p.flatten(-2))
            prefix = prefix + self.mlp(self.prefix_norm2(prefix))
        if target is not None:
            branch = self.attn.proj(out_t.flatten(-2))
            if not indexed:
                target = target + gate1 * branch
                target = target + gate2 * self.mlp(_modulate(self.target_norm2(target), shift2, scale2))
            else:
                target, hidden = fused.gated_residual_layer_norm_modulate(
                    target,
                    gate1,
                    branch,
                    shift2,
                    scale2,
                    target_row_ids,
                    eps=self.target_norm2.eps,
                    quantize=fused.wants_fp8_input(self.mlp.fc1, target),
                )
                target = fused.gated_residual(target, gate2, self.mlp(hidden), target_row_ids)
        return prefix, target


class TimestepEmbedding(nn.Module):
    """t in [0, 1] -> sinusoidal features of 1000 t -> MLP."""

    def __init__(self, frequencies: int, width: int) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.fc1 = nn.Linear(frequencies, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, t: Tensor) -> Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = 1000.0 * t.float().unsqueeze(-1) * freqs
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(features)))


class FinalLayer(nn.Module):
    fused_ops = True  # flat layout: omni_models.fused.layer_norm_modulate (else the unfused torch sequence)

    def __init__(self, width: int, patch_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6, elementwise_affine=False)
        self.modulation = nn.Linear(width, 2 * width)
        self.linear = nn.Linear(width, patch_dim)

    def forward(self, target: Tensor, target_cond: Tensor, target_row_ids: Tensor | None = None) -> Tensor:
        modulation = self.modulation(F.silu(target_cond))
        if target_row_ids is None or not self.fused_ops:
            shift, scale = _per_token(modulation, target_row_ids).chunk(2, dim=-1)
            return self.linear(_modulate(self.norm(target), shift, scale))
        shift, scale = modulation.chunk(2, dim=-1)
        return self.linear(fused.layer_norm_modulate(target, shift, scale, target_row_ids, eps=self.norm.eps))


def sincos_2d(grid_height: int, grid_width: int, width: int, device: torch.device | str = "cpu") -> Tensor:
    """Fixed 2D sin-cos position table [grid_height * grid_width, width], row-major."""
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64, device=device) / quarter)
    ys, xs = torch.meshgrid(
        torch.arange(grid_height, dtype=torch.float64, device=device),
        torch.arange(grid_width, dtype=torch.float64, device=device),
        indexing="ij",
    )
    parts = []
    for coord in (ys.flatten(), xs.flatten()):
        angles = coord[:, None] * omega[None]
        parts += [torch.sin(angles), torch.cos(angles)]
    table = torch.cat(parts, dim=1)
    return F.pad(table, (0, width - table.shape[1])).float()


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """[B, C, H, W] -> [B, (H/p)(W/p), p*p*C], patches row-major."""
    b, c, h, w = images.shape
    p = patch_size
    return images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), -1)


def unpatchify(tokens: Tensor, patch_size: int, height: int, width: int, channels: int = 3) -> Tensor:
    """Inverse of ``patchify``."""
    b = tokens.shape[0]
    p = patch_size
    x = tokens.reshape(b, height // p, width // p, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, height, width)


@dataclass
class PrefixKV:
    """Dense per-layer prefix keys/values [B, L, heads, head_size] and the key mask [B, L] (False = padding)."""

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor


def causal_prefix_mask(text_valid: Tensor, num_target: int) -> Tensor:
    """Boolean attention mask [B, 1, L+T, L+T] of the joint sequence (True = may attend).

    Text query i sees valid text keys j <= i; image queries see every valid text key and every image key.
    Padding queries see BOS (always valid), so no row of the mask is empty.
    """
    b, num_text = text_valid.shape
    total = num_text + num_target
    device = text_valid.device
    key_valid = torch.cat([text_valid, torch.ones(b, num_target, dtype=torch.bool, device=device)], dim=1)
    positions = torch.arange(total, device=device)
    causal = positions.view(1, -1) <= positions.view(-1, 1)  # [q, k]
    is_target_query = positions.view(-1, 1) >= num_text
    allowed = (causal | is_target_query).unsqueeze(0) & key_valid.unsqueeze(1)
    return allowed.unsqueeze(1)


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(-3, -2)


class CausalPrefixDiT(nn.Module):
    """The model. ``forward`` is the dense joint reference; ``encode_prefix`` + ``forward_target`` split it."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        width = config.width
        self.token_embedding = nn.Embedding(config.vocab_size, width)
        self.prefix_positions = nn.Embedding(config.max_prompt_tokens, width)
        self.patch_embedding = nn.Linear(config.patch_dim, width)
        self.timestep_embedding = TimestepEmbedding(config.timestep_frequencies, width)
        self.blocks = nn.ModuleList(
            CausalPrefixBlock(width, config.num_heads, config.mlp_ratio, index) for index in range(config.depth)
        )
        self.final_layer = FinalLayer(width, config.patch_dim)
        self._position_tables: dict[tuple[int, int, str], Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.prefix_positions.weight, std=0.02)
        for layer in (self.timestep_embedding.fc1, self.timestep_embedding.fc2):
            nn.init.normal_(layer.weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.modulation.weight)
            nn.init.zeros_(block.modulation.bias)
        for layer in (self.final_layer.modulation, self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_fused_ops(self, enabled: bool) -> None:
        """Use the fused token ops (default) or the unfused torch sequence in every block, norm and final layer."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, CausalPrefixBlock, FinalLayer)):
                module.fused_ops = bool(enabled)

    # --- embeddings ---------------------------------------------------------------------------------------------

    def embed_prefix(self, token_ids: Tensor, positions: Tensor) -> Tensor:
        """Token ids and their positions in the prompt (same shape, any layout) -> prefix hidden states."""
        return self.token_embedding(token_ids) + self.prefix_positions(positions)

    def target_positions(self, height: int, width: int, device: torch.device | str) -> Tensor:
        """The fixed position table [T, width] for a height x width image (cached per size and device)."""
        p = self.config.patch_size
        key = (height, width, str(device))
        if key not in self._position_tables:
            self._position_tables[key] = sincos_2d(height // p, width // p, self.config.width, device)
        return self._position_tables[key]

    def embed_target(self, patches: Tensor, position_table: Tensor) -> Tensor:
        return self.patch_embedding(patches) + position_table.to(patches.dtype)

    def timestep_condition(self, t: Tensor) -> Tensor:
        return self.timestep_embedding(t)

    # --- dense reference paths ----------------------------------------------------------------------------------

    def forward(self, token_ids: Tensor, images: Tensor, t: Tensor) -> Tensor:
        """Velocity for noisy images [B, C, H, W] at times t [B] given padded prompts [B, L] (PAD = 0)."""
        b, _, height, width = images.shape
        num_text = token_ids.shape[1]
        text_valid = token_ids != PAD_ID
        prefix = self.embed_prefix(token_ids, torch.arange(num_text, device=token_ids.device))
        patches = patchify(images, self.config.patch_size)
        target = self.embed_target(patches, self.target_positions(height, width, images.device))
        cond = self.timestep_condition(t)
        mask = causal_prefix_mask(text_valid, patches.shape[1])

        def attend(attn: JointAttention, prefix: QKV, target: QKV) -> tuple[Tensor, Tensor]:
            q, k, v = (_heads_first(torch.cat(pair, dim=1)) for pair in zip(prefix, target, strict=True))
            out = _heads_first(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            return out[:, :num_text], out[:, num_text:]

        for block in self.blocks:
            prefix, target = block(prefix, target, cond, attend)
        velocity = self.final_layer(target, cond)
        return unpatchify(velocity, self.config.patch_size, height, width, self.config.in_channels)

    def encode_prefix(self, token_ids: Tensor) -> PrefixKV:
        """Every layer's prefix K/V for padded prompts [B, L], computed once (they never depend on the image)."""
        num_text = token_ids.shape[1]
        text_valid = token_ids != PAD_ID
        prefix = self.embed_prefix(token_ids, torch.arange(num_text, device=token_ids.device))
        mask = causal_prefix_mask(text_valid, 0)
        cache = PrefixKV(keys=[], values=[], valid=text_valid)

        def attend(attn: JointAttention, prefix: QKV, target: None) -> tuple[Tensor, None]:
            cache.keys.append(prefix.key)
            cache.values.append(prefix.value)
            q, k, v = (_heads_first(x) for x in prefix)
            return _heads_first(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), None

        for block in self.blocks:
            prefix, _ = block(prefix, None, None, attend)
        return cache

    def forward_target(self, images: Tensor, t: Tensor, prefix_kv: PrefixKV) -> Tensor:
        """Velocity like ``forward``, reading the prefix K/V from ``encode_prefix`` instead of recomputing them."""
        b, _, height, width = images.shape
        patches = patchify(images, self.config.patch_size)
        num_target = patches.shape[1]
        target = self.embed_target(patches, self.target_positions(height, width, images.device))
        cond = self.timestep_condition(t)
        key_valid = torch.cat(
            [prefix_kv.valid, torch.ones(b, num_target, dtype=torch.bool, device=images.device)], dim=1
        )
        mask = key_valid.view(b, 1, 1, -1)

        def attend(attn: JointAttention, prefix: None, target: QKV) -> tuple[None, Tensor]:
            k = torch.cat([prefix_kv.keys[attn.layer_index].to(target.key.dtype), target.key], dim=1)
            v = torch.cat([prefix_kv.values[attn.layer_index].to(target.value.dtype), target.value], dim=1)
            out = F.scaled_dot_product_attention(
                _heads_first(target.query), _heads_first(k), _heads_first(v), attn_mask=mask
            )
            return None, _heads_first(out)

        for block in self.blocks:
            _, target = block(None, target, cond, attend)
        velocity = self.final_layer(target, cond)
        return unpatchify(velocity, self.config.patch_size, height, width, self.config.in_channels)
