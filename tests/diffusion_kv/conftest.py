"""Shared fixtures of the diffusion_kv tests; puts this folder on `sys.path` for `kv_builders`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["builtin", "native"])
def kind(request):
    """Allocator kind; the native one (a real vLLM KVCacheManager) is skipped without vLLM."""
    if request.param == "native":
        pytest.importorskip("vllm")
    return request.param
