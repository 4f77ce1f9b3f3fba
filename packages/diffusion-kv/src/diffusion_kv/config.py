"""KV cache mode and the sizing inputs that paged mode consumes.

``dense_legacy`` keeps a model's own dense K/V handling (no paging);
``paged_scheduler`` makes the Scheduler own paging: it reserves blocks through
``DiffusionKVCacheManager`` and Workers install the resulting block tables.
The sizing fields below are read only in ``paged_scheduler`` mode.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from diffusion_kv._validation import is_positive_int


class DiffusionKVCacheMode(str, enum.Enum):
    """How a diffusion pipeline holds K/V.

    ``PAGED_WORKER_LOCAL`` is a reserved name (Worker-owned paging without a
    Scheduler reservation); it is not implemented and parsing rejects it.
    """

    DENSE_LEGACY = "dense_legacy"
    PAGED_SCHEDULER = "paged_scheduler"
    PAGED_WORKER_LOCAL = "paged_worker_local"


_SUPPORTED_MODES = (DiffusionKVCacheMode.DENSE_LEGACY, DiffusionKVCacheMode.PAGED_SCHEDULER)


def parse_diffusion_kv_cache_mode(value: str | DiffusionKVCacheMode) -> DiffusionKVCacheMode:
    """Return the supported mode named by ``value`` or raise ``ValueError``."""
    if isinstance(value, DiffusionKVCacheMode):
        mode = value
    else:
        try:
            mode = DiffusionKVCacheMode(value)
        except ValueError:
            mode = None
    if mode not in _SUPPORTED_MODES:
        expected = ", ".join(repr(m.value) for m in _SUPPORTED_MODES)
        raise ValueError(f"Unsupported Diffusion KV diffusion_kv_mode {value!r}; expected one of: {expected}")
    return mode


def is_scheduler_paged_kv_mode(mode: str | DiffusionKVCacheMode) -> bool:
    """True only for ``paged_scheduler`` (the Scheduler owns block reservation)."""
    return mode == DiffusionKVCacheMode.PAGED_SCHEDULER


def worker_row_pool_size(max_num_seqs: int, max_rows_per_request: int) -> int:
    """Rows each Worker's block table needs: ``max_num_seqs * max_rows_per_request``.

    Worker rows are held only by *scheduled* requests (at most
    ``max_num_seqs``, each within the per-request row limit), so a pool of this
    size can never overflow; prefetched or draining reservations hold blocks,
    not rows.
    """
    if not is_positive_int(max_rows_per_request):
        raise ValueError("paged_scheduler requires a positive diffusion_kv_max_rows_per_request")
    if not is_positive_int(max_num_seqs):
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    return max_num_seqs * max_rows_per_request


@dataclass(frozen=True)
class DiffusionKVConfig:
    """Validated KV sizing inputs of one pipeline stage.

    - ``gpu_memory_utilization``: per-stage total memory target; used for
      automatic KV-cache sizing. In (0, 1].
    - ``kv_cache_memory_bytes``: explicit per-rank KV-cache budget in bytes;
      overrides automatic sizing. ``None`` and ``0`` both mean "size
      automatically" (an explicit budget still runs one profile forward).
    - ``max_num_batched_tokens``: token budget of one forward; also contributes
      to the native maximum in-flight token limit.
    - ``max_model_len``: longest row in tokens; ``-1`` enables native
      cache-capacity auto-fitting.
    - ``max_num_seqs``: public requests scheduled at once.
    - ``diffusion_kv_max_rows_per_request``: CFG rows + contexts one request may
      use; required (positive) in ``paged_scheduler`` mode.
    """

    diffusion_kv_mode: DiffusionKVCacheMode = DiffusionKVCacheMode.DENSE_LEGACY
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 1
    diffusion_kv_max_rows_per_request: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "diffusion_kv_mode", parse_diffusion_kv_cache_mode(self.diffusion_kv_mode))
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 0:
            raise ValueError("kv_cache_memory_bytes must be non-negative")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0 and self.max_model_len != -1:
            raise ValueError("max_model_len must be positive or -1")
        if not is_positive_int(self.max_num_seqs):
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        rows = self.diffusion_kv_max_rows_per_request
        if rows is not None and not is_positive_int(rows):
            raise ValueError(f"diffusion_kv_max_rows_per_request must be a positive integer, got {rows!r}")
        if self.is_paged and rows is None:
            raise ValueError("paged_scheduler requires a positive diffusion_kv_max_rows_per_request")

    @property
    def is_paged(self) -> bool:
        return is_scheduler_paged_kv_mode(self.diffusion_kv_mode)

    @property
    def worker_row_pool_size(self) -> int:
        """Worker block-table rows for this stage (paged mode only)."""
        if not self.is_paged:
            raise ValueError("dense_legacy mode has no Worker row pool; set diffusion_kv_mode='paged_scheduler'")
        assert self.diffusion_kv_max_rows_per_request is not None  # enforced in __post_init__
        return worker_row_pool_size(self.max_num_seqs, self.diffusion_kv_max_rows_per_request)

    def to_dict(self) -> dict[str, Any]:
        """Plain structured form (the mode as its string value) for deploy configs."""
        data = asdict(self)
        data["diffusion_kv_mode"] = self.diffusion_kv_mode.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DiffusionKVConfig:
        """Inverse of ``to_dict``; unknown keys are an error (a typo must not be ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown Diffusion KV config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**dict(data))


__all__ = [
    "DiffusionKVCacheMode",
    "DiffusionKVConfig",
    "is_scheduler_paged_kv_mode",
    "parse_diffusion_kv_cache_mode",
    "worker_row_pool_size",
]
