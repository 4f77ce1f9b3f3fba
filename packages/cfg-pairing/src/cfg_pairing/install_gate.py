"""Engine-side install gate: does a stage declare CFG pairs?

A stage declares pairing either through a CFG logits processor (any entry whose
class name, or dotted string for an unresolved entry, contains
``CFGLogitsProcessor``) or through a ``cfg_role`` default in its sampling
``extra_args``. Only such stages get the scheduler patches; every other stage
keeps vLLM's scheduler exactly as shipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CFG_LOGITS_PROCESSOR_MARKER = "CFGLogitsProcessor"


def _processor_name(entry: Any) -> str:
    return getattr(entry, "__name__", None) or str(entry)


def stage_declares_cfg_pairs(model_config: Any) -> bool:
    """True iff ``model_config`` declares a CFG logits processor or a ``cfg_role`` extra-args default.

    Reads ``logits_processors`` and ``sampling_extra_args_keys``; either may be
    missing or ``None``.
    """
    processors = getattr(model_config, "logits_processors", None) or ()
    if any(CFG_LOGITS_PROCESSOR_MARKER in _processor_name(entry) for entry in processors):
        return True
    return "cfg_role" in (getattr(model_config, "sampling_extra_args_keys", None) or ())


def sampling_extra_args_keys(default_sampling_params: Any) -> tuple[str, ...]:
    """Sorted key names (never values) of ``default_sampling_params["extra_args"]``.

    ``default_sampling_params`` is a mapping or an object with an ``extra_args``
    attribute; ``extra_args`` is a mapping or an object whose ``vars()`` are
    its fields. Anything absent or unusable gives ``()``.
    """
    if default_sampling_params is None:
        return ()
    if isinstance(default_sampling_params, Mapping):
        extra_args = default_sampling_params.get("extra_args")
    else:
        extra_args = getattr(default_sampling_params, "extra_args", None)
    if extra_args is None:
        return ()
    if not isinstance(extra_args, Mapping):
        try:
            extra_args = vars(extra_args)
        except TypeError:
            return ()
    try:
        return tuple(sorted(key for key in extra_args if isinstance(key, str)))
    except TypeError:
        return ()


def cfg_scheduler_cls(async_scheduling: bool = False) -> type:
    """`CFGPairingAsyncScheduler` or `CFGPairingScheduler`, matching vLLM's sync/async choice (imports vLLM)."""
    from cfg_pairing._vllm import scheduler_cls_for

    return scheduler_cls_for(async_scheduling)


def configure_cfg_scheduler(vllm_config: Any) -> bool:
    """Select the pairing scheduler in ``vllm_config.scheduler_config`` if the stage declares CFG pairs.

    Returns whether it did. Stages that do not declare pairs are left
    untouched. A stage that declares pairs but already names another
    ``scheduler_cls`` gets a ``ValueError`` (two schedulers cannot both run).
    """
    if not stage_declares_cfg_pairs(getattr(vllm_config, "model_config", None)):
        return False
    scheduler_config = vllm_config.scheduler_config
    wanted = cfg_scheduler_cls(bool(getattr(scheduler_config, "async_scheduling", False)))
    current = getattr(scheduler_config, "scheduler_cls", None)
    if (
        current is not None
        and current is not wanted
        and not (isinstance(current, type) and issubclass(current, wanted))
    ):
        raise ValueError(
            f"this stage declares CFG pairs but its scheduler_cls is {current!r}; leave scheduler_cls unset "
            f"(the pairing scheduler {wanted.__qualname__} is selected for it) or subclass {wanted.__qualname__}"
        )
    scheduler_config.scheduler_cls = wanted
    return True
