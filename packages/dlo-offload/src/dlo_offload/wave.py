"""The DP request-wave contract for AllGather mode.

With AllGather, every rank of the DLO group must issue the same collectives in
the same order, so the requests that run concurrently on the DP ranks (one per
rank, a "wave") must have the same forward schedule. A wave that cannot form is
refused on every rank alike, before any weight collective runs. A wave that does
not complete in time (a peer hung or died) fails closed: the coordinator is
marked failed, its failure callbacks run, and it refuses every later wave,
because a rank stuck in a collective leaves the process group unusable.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WAVE_TIMEOUT_ENV = "OMNI_DLO_WAVE_TIMEOUT_S"


def default_wave_timeout_s() -> float:
    """Seconds a wave may take to form: ``$OMNI_DLO_WAVE_TIMEOUT_S`` or 600."""
    raw = os.environ.get(WAVE_TIMEOUT_ENV, "600")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{WAVE_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{WAVE_TIMEOUT_ENV} must be > 0 seconds, got {value}")
    return value


@dataclass(frozen=True)
class WaveRequest:
    """What a rank must agree on with its peers before running a request in a wave.

    Attributes:
        request_id: the caller's id, echoed in errors.
        num_inference_steps: the explicit step count (None is refused).
        prompt: the prompt; an empty one is refused.
        schedule_key: everything else that changes the forward schedule (shape, CFG,
            output count, LoRA); must be JSON-serialisable and equal across the wave.
        extra_args: free-form arguments; must be identical across the wave.
    """

    request_id: str
    num_inference_steps: int | None
    prompt: object
    schedule_key: object = None
    extra_args: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "request_id": self.request_id,
                "num_inference_steps": self.num_inference_steps,
                "prompt_empty": _is_empty_prompt(self.prompt),
                "schedule_key": self.schedule_key,
                "extra_args": _canonical(self.extra_args),
            },
            default=repr,
        )


class WaveRefusedError(ValueError):
    """The requests cannot run as one collective wave; nothing was run."""


class WaveFailedError(TimeoutError):
    """A wave did not form within its timeout (or a peer died); the coordinator is closed."""


def _canonical(extra_args: Mapping[str, object]) -> str:
    return json.dumps(dict(extra_args), sort_keys=True, default=repr)


def _is_empty_prompt(prompt: object) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, (str, list, tuple)):
        return len(prompt) == 0
    if isinstance(prompt, dict):
        return not any(prompt.get(k) for k in ("prompt", "prompt_token_ids", "prompt_ids", "prompt_embeds"))
    return False


def validate_wave(requests: Sequence[WaveRequest]) -> None:
    """Raise `WaveRefusedError` unless `requests` can run as one collective wave."""
    empty = [r.request_id for r in requests if _is_empty_prompt(r.prompt)]
    if empty:
        raise WaveRefusedError(
            f"DP multi-concurrency requires a non-empty prompt for every request; empty prompt request IDs: {empty}"
        )
    steps = [r.num_inference_steps for r in requests]
    if any(s is None for s in steps) or len(set(steps)) > 1:
        raise WaveRefusedError(
            "DP multi-concurrency requires all concurrent requests to have the same explicit "
            f"num_inference_steps (None is not allowed), got {steps} for requests "
            f"{[r.request_id for r in requests]}; run them in separate waves"
        )
    if len({json.dumps(r.schedule_key, sort_keys=True, default=repr) for r in requests}) > 1:
        raise WaveRefusedError(
            "DLO DP multi-concurrency requires compatible shape, CFG, denoise schedule, output count, and LoRA "
            "settings for all requests in one collective wave."
        )
    if len({_canonical(r.extra_args) for r in requests}) > 1:
        raise WaveRefusedError(
            "DP multi-concurrency requires all concurrent requests to share identical extra_args. "
            "Different extra_args can change the forward schedule and cause AllGather deadlock."
        )


class DPWaveCoordinator:
    """Forms waves across the ranks of a DP group over a CPU (gloo) group.

    `form_wave` is a collective: every rank passes its own request and gets the
    whole wave back in rank order, or every rank gets the same `WaveRefusedError`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float | None = None,
        on_failure: Sequence[Callable[[BaseException], None]] = (),
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; the DP wave coordinator needs a process group")
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"the DP wave coordinator exchanges request metadata on the CPU and needs a gloo group, got "
                f"{backend!r}; create one with torch.distributed.new_group(ranks, backend='gloo')"
            )
        self.group = group
        self.timeout_s = default_wave_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.failed: BaseException | None = None
        self._on_failure = list(on_failure)

    def form_wave(self, request: WaveRequest) -> list[WaveRequest]:
        if self.failed is not None:
            raise WaveFailedError(
                f"the DP wave group failed closed earlier ({self.failed}); recreate the worker group before "
                "submitting more waves"
            )
        payload = request.to_json().encode()
        deadline = time.monotonic() + self.timeout_s
        try:
            sizes = self._gather(torch.tensor([len(payload)], dtype=torch.int64), deadline)
            longest = int(sizes.max())
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            every = self._gather(mine, deadline).view(self.world_size, longest)
        except RuntimeError as exc:
            waited = self.timeout_s - (deadline - time.monotonic())
            if waited >= self.timeout_s * 0.99:
                what = f"DLO DP collective wave timed out after {self.timeout_s:.1f}s"
            else:
                what = f"DLO DP collective wave failed after {waited:.1f}s (a peer left or the group broke)"
            self._fail(what, exc)
            raise WaveFailedError(f"{what}; the worker group is closed: {exc}") from exc
        infos = [json.loads(bytes(every[r, : int(sizes[r])].tolist()).decode()) for r in range(self.world_size)]
        wave = [
            WaveRequest(
                request_id=info["request_id"],
                num_inference_steps=info["num_inference_steps"],
                prompt=None if info["prompt_empty"] else "<non-empty>",
                schedule_key=info["schedule_key"],
                extra_args=json.loads(info["extra_args"]),
            )
            for info in infos
        ]
        # Every rank validates the same decoded wave, so every rank decides alike.
        validate_wave(wave)
        wave[self.rank] = request
        return wave

    def _gather(self, tensor: torch.Tensor, deadline: float) -> torch.Tensor:
        out = torch.empty(tensor.numel() * self.world_size, dtype=tensor.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, tensor, group=self.group, async_op=True)
        remaining = max(deadline - time.monotonic(), 0.001)
        work.wait(timeout=timedelta(seconds=remaining))
        return out

    def _fail(self, what: str, exc: BaseException) -> None:
        self.failed = exc
        logger.error("%s; shutting down the worker group: %s", what, exc)
        for callback in self._on_failure:
            try:
                callback(exc)
            except Exception:
                logger.exception("a DP wave failure callback raised")
