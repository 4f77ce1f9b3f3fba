"""`import diffusion_kv` works where vLLM cannot be imported, and vLLM-only features say what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK_VLLM = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class BlockVLLM(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError(f"No module named {name!r} (blocked by test)")
            return None

    sys.meta_path.insert(0, BlockVLLM())
    """
)

_SCRIPT = textwrap.dedent(
    """
    import diffusion_kv
    from diffusion_kv import (
        BlockPoolConfig, BuiltinBlockPool, DiffusionKVCacheManager, DiffusionKVContext,
        DiffusionKVRequest, DiffusionKVScheduler, sequence_request_id,
    )
    from diffusion_kv import _vllm

    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    assert _vllm.vllm_available() is False

    manager = DiffusionKVCacheManager(
        BlockPoolConfig(num_blocks=8, block_size=4), max_model_len=32,
        scheduler_block_size=4, hash_block_size=4, max_rows_per_request=3,
    )
    assert isinstance(manager.allocator, BuiltinBlockPool) and manager.native_manager is None
    text = DiffusionKVContext("text", "cross.text", 4)
    rows = [
        DiffusionKVRequest(sequence_request_id("pub", i), sequence_id=i, prefix_len=2, target_len=6,
                           seq_len=8, kv_contexts=(text,))
        for i in range(2)
    ]

    class Req:
        request_id = "pub"
        diffusion_kv_requests = rows

    scheduler = DiffusionKVScheduler(manager, max_num_seqs=1)
    scheduler.add_request(Req())
    metadata = scheduler.schedule().scheduled_new_reqs[0].diffusion_kv_metadata
    assert [s.block_ids for s in metadata.sequences] == [([1, 2],), ([3, 4],)]
    assert metadata.contexts[0].block_ids == ([5],)
    assert manager.get_num_free_blocks() == 2
    scheduler.close()
    assert manager.get_num_free_blocks() == 7

    for attempt in (
        lambda: DiffusionKVCacheManager(
            BlockPoolConfig(8, 4), max_model_len=32, scheduler_block_size=4, hash_block_size=4,
            max_rows_per_request=1, allocator="native",
        ),
        lambda: _vllm.make_full_attention_kv_cache_config(8, 4),
    ):
        try:
            attempt()
        except ImportError as exc:
            message = str(exc)
            assert "pip install 'diffusion-kv[cpu]'" in message, message
            assert "pip install 'diffusion-kv[cuda]'" in message, message
        else:
            raise AssertionError("a vLLM-only feature worked without vLLM")
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    print("OK")
    """
)


def test_import_and_builtin_pool_work_with_vllm_blocked():
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_VLLM + _SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK")
