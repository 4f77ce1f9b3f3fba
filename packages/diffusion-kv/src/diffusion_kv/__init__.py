"""Paged KV cache for diffusion transformers: atomic CFG reservation over vLLM's KVCacheManager, shared contexts,
scheduler admission, worker block tables and paged non-causal attention."""

__version__ = "0.5.0"

from diffusion_kv._validation import cdiv
from diffusion_kv.allocator import BlockAllocator, BlockPoolConfig, BuiltinBlockPool
from diffusion_kv.batch import BatchRow, PreparedBatch, prepare_batch
from diffusion_kv.cache import allocate_kv_caches
from diffusion_kv.errors import DiffusionKVAdmissionError, DiffusionKVInvariantError
from diffusion_kv.manager import DiffusionKVCacheManager
from diffusion_kv.metadata import (
    DiffusionKVContextMetadata,
    DiffusionKVMetadata,
    DiffusionKVSequenceMetadata,
)
from diffusion_kv.ops import PagedAttentionMetadata, paged_attention, write_kv_cache
from diffusion_kv.request import (
    DiffusionKVContext,
    DiffusionKVRequest,
    RequestStatus,
    context_request_id,
    sequence_request_id,
)
from diffusion_kv.scheduler import (
    DiffusionKVScheduler,
    NewRequestData,
    RequestState,
    SchedulerOutput,
    SchedulingPolicy,
    validate_new_request_data_identity,
)
from diffusion_kv.sizing import (
    KVCacheConfigs,
    KVPoolSizing,
    build_kv_cache_configs,
    requested_device_memory,
    size_kv_pool,
)
from diffusion_kv.specs import (
    PRIMARY_CACHE_ROLE,
    AttentionCacheSpec,
    KVCacheOptIn,
    discover_kv_cache_specs,
    registered_roles,
)
from diffusion_kv.worker import RowIdentity, WorkerRowTable

__all__ = [
    # control plane
    "BlockAllocator",
    "BlockPoolConfig",
    "BuiltinBlockPool",
    "DiffusionKVAdmissionError",
    "DiffusionKVCacheManager",
    "DiffusionKVContext",
    "DiffusionKVContextMetadata",
    "DiffusionKVInvariantError",
    "DiffusionKVMetadata",
    "DiffusionKVRequest",
    "DiffusionKVScheduler",
    "DiffusionKVSequenceMetadata",
    "NewRequestData",
    "RequestState",
    "RequestStatus",
    "SchedulerOutput",
    "SchedulingPolicy",
    "context_request_id",
    "sequence_request_id",
    "validate_new_request_data_identity",
    # data plane
    "PRIMARY_CACHE_ROLE",
    "AttentionCacheSpec",
    "BatchRow",
    "KVCacheConfigs",
    "KVCacheOptIn",
    "KVPoolSizing",
    "PagedAttentionMetadata",
    "PreparedBatch",
    "RowIdentity",
    "WorkerRowTable",
    "allocate_kv_caches",
    "build_kv_cache_configs",
    "cdiv",
    "discover_kv_cache_specs",
    "paged_attention",
    "prepare_batch",
    "registered_roles",
    "requested_device_memory",
    "size_kv_pool",
    "write_kv_cache",
]
