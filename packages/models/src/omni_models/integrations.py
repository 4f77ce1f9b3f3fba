"""What each model declares to omni's libraries: paged-KV opt-in, offload plan, FP8-able linears.

The causal-prefix DiT (the shipped model) declares its own here; each diffusers family declares its
``FamilyDeclaration`` in its module (``omni_models.backends``), applied by the two functions at the end. Each
declaration goes through the library's public API; the libraries are imported only where a declaration is
applied, so the model itself (and training) needs none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from omni_models.model import CausalPrefixDiT

if TYPE_CHECKING:
    from dlo_offload import OffloadPlan
    from fp8_cache import QuantizationReport
    from omni_models.families import FamilyDeclaration

# Modules outside the repeated blocks: small, used by every step, so they stay on the device under offload.
RESIDENT_MODULES: tuple[str, ...] = (
    "token_embedding",
    "prefix_positions",
    "patch_embedding",
    "timestep_embedding",
    "final_layer",
)

# The families' FP8 linears scale activations per row: eager, one fused Triton kernel per input (per tensor takes
# a reduction pass, a cast pass and a fill), and compiled, rowwise was the faster of the two (benchmarks/RESULTS.md).
FAMILY_ACTIVATION_SCALING = "row"
# Linears that stay in high precision under FP8: everything outside the blocks (input/output projections and
# the timestep MLP, where precision matters most and the FLOPs are negligible) and the per-block adaLN
# modulation (one row per image, so FP8 would save nothing and perturb every token's scale and shift).
FP8_IGNORE: tuple[str, ...] = ("patch_embedding", "timestep_embedding.*", "final_layer.*", "blocks.*.modulation")


def declare_kv_cache(model: CausalPrefixDiT, dtype: torch.dtype) -> None:
    """Opt every attention layer into the paged cache (``diffusion_kv.PRIMARY_CACHE_ROLE``), K/V in ``dtype``."""
    from diffusion_kv import PRIMARY_CACHE_ROLE, KVCacheOptIn

    for block in model.blocks:
        block.attn.diffusion_kv_cache = KVCacheOptIn(
            cache_role=PRIMARY_CACHE_ROLE,
            num_kv_heads=block.attn.num_heads,
            head_size=block.attn.head_size,
            dtype=dtype,
        )


def offload_plan(resident_blocks: int = 0) -> OffloadPlan:
    """Layerwise offload of the blocks; embeddings and the final layer stay resident."""
    from dlo_offload import OffloadPlan

    return OffloadPlan(blocks="blocks", resident_blocks=resident_blocks, resident_modules=RESIDENT_MODULES)


def quantize_fp8(model: CausalPrefixDiT) -> QuantizationReport:
    """Swap the blocks' attention and MLP linears for FP8 linears in place (see FP8_IGNORE for the rest)."""
    from fp8_cache import quantize_model

    return quantize_model(model, ignore=FP8_IGNORE)


def family_offload_plan(declaration: FamilyDeclaration, resident_blocks: int = 0) -> OffloadPlan:
    """Layerwise offload of a family's block lists (in execution order); everything else stays resident."""
    from dlo_offload import OffloadPlan

    return OffloadPlan(
        blocks=declaration.block_lists, resident_blocks=resident_blocks, resident_modules=declaration.resident_modules
    )


def quantize_family_fp8(declaration: FamilyDeclaration, transformer: torch.nn.Module) -> QuantizationReport:
    """Swap a family transformer's linears for FP8 linears in place, except the family's ``fp8_ignore``.

    Activations get one scale per row (``FAMILY_ACTIVATION_SCALING``)."""
    from fp8_cache import quantize_model

    return quantize_model(transformer, ignore=declaration.fp8_ignore, activation_scaling=FAMILY_ACTIVATION_SCALING)
