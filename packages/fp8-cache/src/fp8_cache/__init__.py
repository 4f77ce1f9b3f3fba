"""Per-tensor FP8 quantization, FP8 linears, and a normalized, crash-safe on-disk cache of quantized weights.

Model-facing: :func:`quantize_model` swaps eligible ``nn.Linear`` layers for :class:`FP8Linear`;
:func:`load_fp8_state_dict` installs already-quantized weights (a cache hit) into a model, e.g. one built on
the meta device.
Cache-facing: :func:`build_fp8_cache` publishes an artifact atomically, :func:`load_fp8_weights` returns FP8
weights on a device from a hit (bit-identical to online quantization) or quantizes online on a miss,
:func:`load_fp8_cache_manifest` / :func:`check_artifact` / :func:`verify_artifact` validate without raising.
"""

__version__ = "0.6.0"

from fp8_cache.artifact import (
    CACHE_COMPLETE_NAME,
    CACHE_INDEX_NAME,
    CACHE_KIND,
    CACHE_MANIFEST_NAME,
    CACHE_SCHEMA_VERSION,
    QUANTIZATION_CONTRACT,
    CacheManifest,
    Expectation,
    QuantizationContract,
    ShardIndex,
    ShardRecord,
    check_artifact,
    load_fp8_cache_manifest,
    source_fingerprint,
    verify_artifact,
)
from fp8_cache.build import (
    BuildResult,
    build_fp8_cache,
    publish_artifact,
    quantize_state_dict,
    resolve_source_files,
    select_quantized,
)
from fp8_cache.linear import (
    ActivationScaling,
    FP8Activation,
    FP8Linear,
    QuantizationReport,
    fp8_weight_names,
    ineligible_weight_reason,
    load_fp8_state_dict,
    quantize_activation,
    quantize_activation_rows,
    quantize_model,
    quantized_input,
    scaled_mm_available,
)
from fp8_cache.load import LoadResult, load_cached_tensors, load_fp8_weights
from fp8_cache.quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    NonFiniteWeightError,
    dequantize,
    per_row_scales,
    per_tensor_scale,
    quantize_per_tensor,
)
from fp8_cache.safetensors_io import SAFETENSORS_DTYPES

__all__ = [
    "ActivationScaling",
    "CACHE_COMPLETE_NAME",
    "CACHE_INDEX_NAME",
    "CACHE_KIND",
    "CACHE_MANIFEST_NAME",
    "CACHE_SCHEMA_VERSION",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
    "QUANTIZATION_CONTRACT",
    "SAFETENSORS_DTYPES",
    "BuildResult",
    "CacheManifest",
    "Expectation",
    "FP8Activation",
    "FP8Linear",
    "LoadResult",
    "NonFiniteWeightError",
    "QuantizationContract",
    "QuantizationReport",
    "ShardIndex",
    "ShardRecord",
    "build_fp8_cache",
    "check_artifact",
    "dequantize",
    "fp8_weight_names",
    "ineligible_weight_reason",
    "load_cached_tensors",
    "load_fp8_cache_manifest",
    "load_fp8_state_dict",
    "load_fp8_weights",
    "per_row_scales",
    "per_tensor_scale",
    "publish_artifact",
    "quantize_activation",
    "quantize_activation_rows",
    "quantized_input",
    "quantize_model",
    "quantize_per_tensor",
    "quantize_state_dict",
    "resolve_source_files",
    "scaled_mm_available",
    "select_quantized",
    "source_fingerprint",
    "verify_artifact",
]
