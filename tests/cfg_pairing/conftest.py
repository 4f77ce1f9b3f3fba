"""Builds vLLM's real v1 ``Scheduler`` on CPU from configs made here (no downloads)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 16
SAMPLED_TOKEN = 7


@dataclass
class StepRecord:
    scheduled: dict[str, int]
    new_request_ids: list[str]
    computed_after_schedule: dict[str, int]
    engine_outputs: dict[int, Any]


class VllmHarness:
    """Makes schedulers, requests and model-runner outputs the way vLLM's engine core does."""

    def __init__(self, model_config: Any) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        self.model_config = model_config
        self.base_classes = {"sync": Scheduler, "async": AsyncScheduler}
        self.patched_classes = {kind: self._patched_subclass(cls) for kind, cls in self.base_classes.items()}

    @staticmethod
    def _patched_subclass(base: type) -> type:
        from cfg_pairing import CFGPairingAsyncScheduler, CFGPairingScheduler

        # vLLM's own classes stay the baseline; the pairing classes are their subclasses.
        return CFGPairingAsyncScheduler if base.__name__ == "AsyncScheduler" else CFGPairingScheduler

    def scheduler(
        self,
        *,
        patched: bool = True,
        kind: str = "sync",
        num_blocks: int = 200,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
    ) -> Any:
        import torch
        from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
        )
        cache_config = CacheConfig(
            block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=enable_prefix_caching
        )
        cache_config.num_gpu_blocks = num_blocks
        vllm_config = VllmConfig(
            model_config=self.model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer.0"],
                    FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32),
                )
            ],
        )
        cls = (self.patched_classes if patched else self.base_classes)[kind]
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=False,
        )

    @staticmethod
    def request(
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 4,
        extra_args: dict[str, Any] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args, stop_token_ids=stop_token_ids or []
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )

    def pair(self, base_id: str, prompt_len: int, *, max_tokens: int = 4, **kwargs: Any) -> tuple[Any, Any]:
        """A cond request and its uncond twin: same length, different tokens, distinct per ``base_id``."""
        salt = sum(map(ord, base_id))
        cond = self.request(
            base_id,
            [10 + (salt + i) % 200 for i in range(prompt_len)],
            max_tokens=max_tokens,
            extra_args={"cfg_role": "cond"},
            **kwargs,
        )
        uncond = self.request(
            f"{base_id}__cfg_uncond",
            [210 + salt % 40] * prompt_len,
            max_tokens=max_tokens,
            extra_args={"cfg_role": "uncond"},
            **kwargs,
        )
        return cond, uncond

    @staticmethod
    def step(scheduler: Any, token_for: Callable[[str], int] = lambda request_id: SAMPLED_TOKEN) -> StepRecord:
        """One engine step: schedule, 'run the model' (sample where a request reached its end), update."""
        from vllm.v1.outputs import ModelRunnerOutput

        output = scheduler.schedule()
        request_ids = list(output.num_scheduled_tokens)
        computed = {rid: scheduler.requests[rid].num_computed_tokens for rid in scheduler.requests}
        sampled = [
            [token_for(rid)]
            if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
            else []
            for rid in request_ids
        ]
        runner_output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={rid: index for index, rid in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )
        engine_outputs = scheduler.update_from_output(output, runner_output)
        return StepRecord(
            scheduled=dict(output.num_scheduled_tokens),
            new_request_ids=[data.req_id for data in output.scheduled_new_reqs],
            computed_after_schedule=computed,
            engine_outputs=engine_outputs,
        )

    @staticmethod
    def free_blocks(scheduler: Any) -> int:
        return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.fixture(scope="session")
def vllm_harness(tmp_path_factory: pytest.TempPathFactory) -> VllmHarness:
    pytest.importorskip("vllm", reason="the real-scheduler tests need vLLM: pip install 'cfg-pairing[cpu]'")
    from vllm.config import ModelConfig

    model_dir: Path = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024, dtype="float32", seed=0
    )
    return VllmHarness(model_config)
