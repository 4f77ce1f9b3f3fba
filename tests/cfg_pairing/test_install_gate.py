"""The engine-side install gate and the process-wide patch entry points."""

from __future__ import annotations

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
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


def test_import_works_without_vllm_and_patching_says_what_to_install() -> None:
    result = run_python(
        """
        import sys
        sys.modules["vllm"] = None  # as if vLLM were not installed
        import cfg_pairing
        assert not cfg_pairing.cfg_patches_applied()
        try:
            cfg_pairing.apply_cfg_patches()
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("apply_cfg_patches worked without vLLM")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'cfg-pairing[cpu]'" in result.stdout


def test_the_gate_patches_vllm_once_and_only_for_cfg_stages() -> None:
    pytest.importorskip("vllm")
    result = run_python(
        """
        from types import SimpleNamespace
        import cfg_pairing
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        plain_stage = SimpleNamespace(model_config=SimpleNamespace(logits_processors=None))
        assert cfg_pairing.maybe_apply_cfg_scheduler_patches(plain_stage) is False
        assert not hasattr(Scheduler.schedule, "_cfg_pairing_patched")
        assert not cfg_pairing.cfg_patches_applied()

        cfg_stage = SimpleNamespace(model_config=SimpleNamespace(sampling_extra_args_keys=("cfg_role",)))
        assert cfg_pairing.maybe_apply_cfg_scheduler_patches(cfg_stage) is True
        schedule = Scheduler.schedule
        assert schedule._cfg_pairing_patched and schedule._audex_cfg_patched
        assert AsyncScheduler.schedule is schedule
        cfg_pairing.apply_cfg_patches()
        assert Scheduler.schedule is schedule and cfg_pairing.cfg_patches_applied()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
