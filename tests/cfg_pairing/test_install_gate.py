"""The engine-side install gate and the process-wide patch entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from cfg_pairing import sampling_extra_args_keys, stage_declares_cfg_pairs


class AudexCFGLogitsProcessor:
    pass


class MinPLogitsProcessor:
    pass


def test_a_cfg_logits_processor_class_or_dotted_name_declares_pairs() -> None:
    assert stage_declares_cfg_pairs(SimpleNamespace(logits_processors=[AudexCFGLogitsProcessor]))
    assert stage_declares_cfg_pairs(
        SimpleNamespace(logits_processors=["vllm_omni.model_executor.models.audex.cfg:AudexCFGLogitsProcessor"])
    )


def test_a_cfg_role_default_declares_pairs() -> None:
    assert stage_declares_cfg_pairs(
        SimpleNamespace(logits_processors=None, sampling_extra_args_keys=("cfg_role", "cfg_scale"))
    )


def test_other_stages_do_not_declare_pairs() -> None:
    assert not stage_declares_cfg_pairs(SimpleNamespace(logits_processors=[], sampling_extra_args_keys=()))
    assert not stage_declares_cfg_pairs(
        SimpleNamespace(
            logits_processors=[MinPLogitsProcessor, "m:MinPLogitsProcessor"], sampling_extra_args_keys=("tta_rvq",)
        )
    )
    assert not stage_declares_cfg_pairs(SimpleNamespace())
    assert not stage_declares_cfg_pairs(None)


def test_extra_args_keys_are_sorted_names_only() -> None:
    assert sampling_extra_args_keys({"extra_args": {"cfg_scale": 1.5, "cfg_role": "cond"}}) == ("cfg_role", "cfg_scale")
    assert sampling_extra_args_keys(SimpleNamespace(extra_args=SimpleNamespace(seed=1, cfg_role="cond"))) == (
        "cfg_role",
        "seed",
    )
    assert sampling_extra_args_keys({"temperature": 0.1}) == ()
    assert sampling_extra_args_keys({"extra_args": None}) == ()
    assert sampling_extra_args_keys({"extra_args": 3}) == ()
    assert sampling_extra_args_keys(None) == ()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )


def test_import_works_without_vllm_and_the_scheduler_says_what_to_install() -> None:
    result = run_python(
        """
        import sys
        sys.modules["vllm"] = None  # as if vLLM were not installed
        import cfg_pairing
        cfg_pairing.CFGPairingMixin
        try:
            cfg_pairing.CFGPairingScheduler
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("CFGPairingScheduler resolved without vLLM")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'cfg-pairing[cpu]'" in result.stdout


def test_the_gate_selects_the_pairing_scheduler_only_for_cfg_stages() -> None:
    pytest.importorskip("vllm")
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    import cfg_pairing

    def stage(model_config: SimpleNamespace, **scheduler_kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=model_config, scheduler_config=SchedulerConfig.default_factory(**scheduler_kwargs)
        )

    plain = stage(SimpleNamespace(logits_processors=None))
    assert cfg_pairing.configure_cfg_scheduler(plain) is False
    assert plain.scheduler_config.get_scheduler_cls() is Scheduler

    paired = stage(SimpleNamespace(sampling_extra_args_keys=("cfg_role",)))
    assert cfg_pairing.configure_cfg_scheduler(paired) is True
    assert paired.scheduler_config.get_scheduler_cls() is cfg_pairing.CFGPairingScheduler
    assert issubclass(cfg_pairing.CFGPairingScheduler, Scheduler)
    # vLLM's own classes are untouched.
    assert "schedule" not in vars(Scheduler) or Scheduler.schedule.__module__.startswith("vllm.")
    assert Scheduler.add_request.__module__.startswith("vllm.")

    paired_async = stage(SimpleNamespace(sampling_extra_args_keys=("cfg_role",)), async_scheduling=True)
    assert cfg_pairing.configure_cfg_scheduler(paired_async) is True
    assert paired_async.scheduler_config.get_scheduler_cls() is cfg_pairing.CFGPairingAsyncScheduler
    assert issubclass(cfg_pairing.CFGPairingAsyncScheduler, AsyncScheduler)

    other = stage(SimpleNamespace(sampling_extra_args_keys=("cfg_role",)), scheduler_cls="my.Scheduler")
    with pytest.raises(ValueError, match="leave scheduler_cls unset"):
        cfg_pairing.configure_cfg_scheduler(other)
    assert other.scheduler_config.scheduler_cls == "my.Scheduler"
