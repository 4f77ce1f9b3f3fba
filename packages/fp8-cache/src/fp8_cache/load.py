"""Getting FP8 weights resident on a device: from the cache on a hit, by online quantization on a miss.

A hit reads the artifact's bytes as stored (no re-quantization), so its tensors are bit-identical to what
online quantization of the same source produces. A miss quantizes on the target device and then tries to
publish the result; a failed publication is logged as a warning and never stops the caller.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8_cache.artifact import DEFAULT_COMPONENT, CacheManifest, Expectation, check_artifact
from fp8_cache.build import (
    SourceSpec,
    publish_artifact,
    quantize_state_dict,
    read_source_specs,
    resolve_source_files,
    select_quantized,
)
from fp8_cache.safetensors_io import SafetensorsFormatError, load_tensors

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    """``tensors``: the component's runtime state dict on the device (FP8 weights, ``*.weight_scale``, rest).

    ``hit`` says where it came from; ``reason`` is ``"hit"`` or why the cache missed; ``published`` is set on
    a miss when publication was attempted (True on success, False on a logged failure).
    """

    tensors: dict[str, torch.Tensor]
    hit: bool
    reason: str
    quantized: list[str]
    published: bool | None = None


def load_cached_tensors(
    cache_dir: str | os.PathLike[str], manifest: CacheManifest, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """All tensors of a validated artifact on ``device`` (mmap views on CPU, pinned staging on CUDA)."""
    component_dir = Path(cache_dir) / manifest.component
    return load_tensors([component_dir / name for name in sorted(manifest.shards)], device)


def load_fp8_weights(
    sources: SourceSpec,
    cache_dir: str | os.PathLike[str] | None,
    *,
    device: torch.device | str,
    component: str = DEFAULT_COMPONENT,
    quantize: Collection[str] | None = None,
    ignore: Sequence[str] = (),
    publish: bool = True,
    elect_writer: bool = True,
) -> LoadResult:
    """FP8 runtime tensors of ``sources`` on ``device``, from ``cache_dir`` when it holds a current artifact.

    ``quantize``/``ignore`` select the FP8 tensors as in :func:`fp8_cache.build.select_quantized`; they are part
    of the cache key, so changing them is a miss. ``cache_dir=None`` always quantizes online.
    """
    files = resolve_source_files(sources)
    quantized = select_quantized(read_source_specs(files), quantize=quantize, ignore=ignore)
    manifest, reason = check_artifact(
        cache_dir, Expectation(component=component, source_files=files, quantized=quantized)
    )
    if manifest is not None:
        try:
            return LoadResult(load_cached_tensors(cache_dir, manifest, device), True, "hit", quantized)
        except (OSError, SafetensorsFormatError) as exc:  # changed under us after validation
            reason = f"artifact became unreadable while loading: {exc}"
    logger.info("FP8 cache miss at %s: %s; quantizing online on %s", cache_dir, reason, device)
    tensors = quantize_state_dict(load_tensors(files, device), quantized)
    result = LoadResult(tensors, False, reason, quantized)
    if publish and cache_dir is not None:
        try:
            publish_artifact(
                tensors.items(),
                cache_dir,
                component=component,
                quantized=quantized,
                source_files=files,
                elect_writer=elect_writer,
            )
            result.published = True
        except Exception:
            logger.warning(
                "publishing the FP8 cache at %s failed; continuing with online-quantized weights",
                cache_dir,
                exc_info=True,
            )
            result.published = False
    return result
