"""One engine core for every model kind: requests become jobs, jobs advance in batched steps, outputs come back.

``EngineCore`` drives any ``omni_models.StepwisePipeline`` (``omni_models.contract``); what differs by kind is
the strategy (``omni_server.strategies``: paged KV admission for the shipped DiT, FIFO for the rest). Each
iteration (``step``):

1. the strategy schedules: admits waiting requests and returns the running ones;
2. ONE forward for the jobs it selects (``--max-rows-per-step``), whatever request or step index each is at:
   first ``pipeline.start`` for jobs that have not started (prompt encoding, prefix K/V, AR rows), then
   ``pipeline.step``. With ``--batch-invariant`` each job runs in a forward of its own. A forward that raises is
   run again one request at a time, so only the culprit fails (``forward_isolating_failures``);
3. requests whose jobs all finished are decoded together (``pipeline.decode``) and encoded (PNG, WAV);
4. the strategy reports every request that ended (completed, aborted, failed); each gets its one
   ``RequestFinished`` and ``pipeline.release`` frees what the pipeline held for it.

LoRA adapters are registered with the pipeline (``pipeline.lora``, ``omni_models.lora``) at load and by
``update_lora`` between iterations; a request names one and its jobs hold it until released.

Invariant: each added request produces exactly one ``RequestFinished`` (outputs or an error, an abort included),
and an error in one request never stops the loop.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from omni_models import GenerationRequest, ModelInfo, ResolvedRequest, StepwisePipeline
from omni_server.config import ServerConfig
from omni_server.protocol import (
    EngineOutput,
    EngineReady,
    EngineStats,
    LoadLoRAAdapter,
    LoRAAdapterUpdated,
    RequestError,
    RequestFinished,
    StepProgress,
    UnloadLoRAAdapter,
)
from omni_server.strategies import BatchedStrategy, Ended, EngineRequest, PagedStrategy

R = TypeVar("R")
logger = logging.getLogger("omni_server.engine")


class Timer:
    """Monotonic timestamps of one request: arrival, first scheduled."""

    __slots__ = ("arrival", "scheduled")

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.scheduled: float | None = None

    def mark_scheduled(self) -> None:
        if self.scheduled is None:
            self.scheduled = time.monotonic()

    def finished(
        self, request_id: str, *, outputs: Iterable[bytes] = (), error: RequestError | None = None
    ) -> RequestFinished:
        now = time.monotonic()
        scheduled = self.scheduled if self.scheduled is not None else now
        return RequestFinished(
            request_id=request_id,
            outputs=list(outputs),
            error=error,
            queue_s=scheduled - self.arrival,
            engine_s=now - self.arrival,
        )


def encode_output(output: object) -> bytes:
    """The file an output travels as: PNG for an image, WAV for a song."""
    wav = getattr(output, "wav", None)
    if wav is not None:
        return wav()
    buffer = io.BytesIO()
    output.save(buffer, format="PNG")
    return buffer.getvalue()


def request_error(exc: BaseException) -> RequestError:
    """Classify one request's failure: the model's ``InvalidRequestError`` is the client's fault."""
    from omni_models import InvalidRequestError

    if isinstance(exc, InvalidRequestError):
        return RequestError(kind="invalid_request", message=str(exc), param=exc.param)
    return RequestError(kind="engine", message=f"{type(exc).__name__}: {exc}")


def fault_injection_hook() -> Callable[[ResolvedRequest], None]:
    """Test-only fault injection, off unless ``OMNI_SERVER_FAULT_PROMPT`` is set in the engine's environment.

    A request whose prompt equals that value raises in every forward that includes it, which lets the end-to-end
    tests prove that one failing request gets a 500 and the server lives on.
    """
    trigger = os.environ.get("OMNI_SERVER_FAULT_PROMPT")

    def check(request: ResolvedRequest) -> None:
        if trigger is not None and request.prompt == trigger:
            raise RuntimeError("injected engine fault (OMNI_SERVER_FAULT_PROMPT)")

    return check


def forward_isolating_failures(
    requests: Sequence[R], forward: Callable[[Sequence[R]], None], fail: Callable[[R, Exception], None]
) -> None:
    """``forward(requests)`` as one batch; if it raises, each request again on its own, so only the culprit
    ``fail``s and the engine lives on.

    Retrying is safe even when the batch raised after stepping: a job's state and step index advance together, so
    a job the batch already advanced just takes its next step.
    """
    try:
        forward(requests)
        return
    except Exception as exc:
        if len(requests) == 1:
            fail(requests[0], exc)
            return
        logger.warning("batched forward for %d requests failed (%s); running them one at a time", len(requests), exc)
    for request in requests:
        try:
            forward([request])
        except Exception as exc:
            fail(request, exc)


def warmup_request(info: ModelInfo, sequence_parallel_size: int = 1) -> GenerationRequest:
    """The cheapest valid request of a model: the engine runs it through every path before reporting ready.

    Under Ulysses SP a family's image tokens must split evenly over the ranks: the side of a size range is then
    ``sequence_parallel_size`` times its smallest (``sp**2`` tokens of 2x2 latent patches)."""
    from omni_models import GenerationRequest

    if info.audio is not None:
        return GenerationRequest(prompt="warm up", lyrics="la", max_new_tokens=2, seed=0)
    height, width = info.image.smallest_size()
    rule = info.image.size_range
    if rule is not None and sequence_parallel_size > 1:
        height = width = min(rule.min_side * sequence_parallel_size, rule.max_side)
    word = info.vocabulary[0] if info.vocabulary else "warm up"
    return GenerationRequest(prompt=word, height=height, width=width, num_inference_steps=2, seed=0)


class EngineCore:
    """Step-level batching of any ``StepwisePipeline`` (see the module docstring). Not thread-safe."""

    def __init__(
        self, pipeline: StepwisePipeline, config: ServerConfig, *, requested_memory: int | None = None
    ) -> None:
        self.pipeline = pipeline
        self.info = pipeline.info
        self._config = config
        self._strategy = (
            PagedStrategy(pipeline, config, requested_memory=requested_memory)
            if self.info.paged_kv
            else BatchedStrategy(pipeline, config)
        )
        self._check_fault = fault_injection_hook()
        self._running: list[EngineRequest] = []
        self._outputs: list[EngineOutput] = []
        self._step_latencies: list[float] = []
        self._live: set[str] = set()  # added and not yet reported
        self._failing: set[str] = set()  # failed, reported by the strategy's next finish()
        self._pid = os.getpid()
        if config.warmup:
            self._warm_up()

    def _warm_up(self) -> None:
        """One real request through every engine path (admit, start, step, decode, free)."""
        from omni_models import resolve_request

        request = warmup_request(self.info, self._config.sequence_parallel_size)
        self.add("warmup", resolve_request(self.info, request))
        outputs: list[EngineOutput] = []
        while not any(isinstance(o, RequestFinished) for o in outputs):
            outputs += self.step()
        finished = next(o for o in outputs if isinstance(o, RequestFinished))
        if finished.error is not None:
            raise RuntimeError(f"warm-up request failed: {finished.error.message}")
        self._step_latencies.clear()

    def ready_message(self) -> EngineReady:
        occupancy = self._strategy.occupancy()
        return EngineReady(
            info=self.info,
            kv_blocks_total=occupancy.kv_blocks_total,
            block_size=self._strategy.block_size,
            pid=self._pid,
        )

    # -- requests ---------------------------------------------------------------------------------------------

    def add(self, request_id: str, request: ResolvedRequest) -> None:
        """Queue one request (checked against the model already); a request the model refuses (an unknown word,
        say) ends at once with its error, before it owns anything."""
        timer = Timer()
        try:
            jobs = self.pipeline.prepare(request, request_id=request_id)
        except Exception as exc:
            self._outputs.append(timer.finished(request_id, error=request_error(exc)))
            return
        self._live.add(request_id)
        self._strategy.add(EngineRequest(request_id, request, jobs, timer))

    def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._strategy.abort(request_id)

    def update_lora(self, command: LoadLoRAAdapter | UnloadLoRAAdapter) -> LoRAAdapterUpdated:
        """Register or unregister an adapter; a refusal (bad file, name taken or unknown, LoRA off) changes
        nothing and says why."""
        from omni_models import LoRAError

        lora = getattr(self.pipeline, "lora", None)
        if lora is None:
            error = RequestError(kind="invalid_request", message="this server does not serve LoRA (--enable-lora)")
            return LoRAAdapterUpdated(call_id=command.call_id, error=error)
        try:
            if isinstance(command, LoadLoRAAdapter):
                adapter = lora.register(command.name, command.path)
                return LoRAAdapterUpdated(call_id=command.call_id, load_s=adapter.load_s)
            lora.unregister(command.name)
            return LoRAAdapterUpdated(call_id=command.call_id)
        except LoRAError as exc:
            error = RequestError(kind="invalid_request", message=str(exc), param="lora_path")
        except KeyError:
            error = RequestError(
                kind="invalid_request",
                message=f"no LoRA adapter named {command.name!r} is loaded",
                param="lora_name",
                code="lora_not_found",
            )
        except ValueError as exc:  # the name is taken
            error = RequestError(kind="invalid_request", message=str(exc), param="lora_name")
        return LoRAAdapterUpdated(call_id=command.call_id, error=error)

    def has_work(self) -> bool:
        return bool(self._outputs) or bool(self._live)

    # -- one iteration ----------------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        outputs, self._outputs = self._outputs, []
        self._running = self._strategy.schedule()
        completed: list[str] = []
        if self._running:
            started = time.monotonic()
            forward_isolating_failures(self._running, self._forward, self._fail_forward)
            self._step_latencies.append(time.monotonic() - started)
            completed = self._complete([r for r in self._running if r.finished and r.request_id not in self._failing])
        for ended in self._strategy.finish(completed):
            outputs.append(self._report(ended))
        outputs.append(self.stats())
        return outputs

    def _forward(self, requests: Sequence[EngineRequest]) -> None:
        for request in requests:
            self._check_fault(request.request)
        jobs = self._strategy.select([job for r in requests for job in r.jobs if not job.finished])
        for part in [[job] for job in jobs] if self._config.batch_invariant else [jobs] if jobs else []:
            self.pipeline.start(part)
            self.pipeline.step(part)

    def _fail_forward(self, request: EngineRequest, exc: Exception) -> None:
        logger.error("forward failed for request %s", request.request_id, exc_info=exc)
        self._fail(request, exc)

    def _fail(self, request: EngineRequest, exc: Exception) -> None:
        self._failing.add(request.request_id)
        self._strategy.fail(request.request_id, request_error(exc))

    def _complete(self, finished: Sequence[EngineRequest]) -> list[str]:
        """Decode and encode every finished request together; on failure, one at a time (only the culprit fails).
        Returns the ids that completed."""
        if not finished:
            return []
        try:
            decoded = self.pipeline.decode([job for request in finished for job in request.jobs])
        except Exception as exc:
            if len(finished) == 1:
                logger.exception("decoding request %s failed", finished[0].request_id)
                self._fail(finished[0], exc)
                return []
            return [rid for request in finished for rid in self._complete([request])]
        offset = 0
        for request in finished:
            request.outputs = [encode_output(out) for out in decoded[offset : offset + len(request.jobs)]]
            offset += len(request.jobs)
        return [request.request_id for request in finished]

    def _report(self, ended: Ended) -> RequestFinished:
        request = ended.request
        self._live.discard(request.request_id)
        self._failing.discard(request.request_id)
        try:
            self.pipeline.release(request.jobs)
        except Exception:  # a release that fails must not take the request's answer or the loop with it
            logger.exception("releasing request %s failed", request.request_id)
        if ended.outcome == "completed":
            return request.timer.finished(request.request_id, outputs=request.outputs)
        return request.timer.finished(request.request_id, error=ended.error)

    def stats(self) -> EngineStats:
        latencies, self._step_latencies = self._step_latencies, []
        occupancy = self._strategy.occupancy()
        return EngineStats(
            running=occupancy.running,
            waiting=occupancy.waiting,
            kv_blocks_used=occupancy.kv_blocks_used,
            kv_blocks_total=occupancy.kv_blocks_total,
            step_latencies_s=latencies,
            progress=[
                StepProgress(r.request_id, r.jobs[0].step_index, r.jobs[0].num_steps)
                for r in self._running
                if r.jobs and r.request_id in self._live
            ],
        )

    def close(self) -> None:
        self._strategy.close()
        self._live.clear()
        self.pipeline.close()


def load_pipeline(config: ServerConfig, **overrides: object) -> StepwisePipeline:
    """The configured model through ``omni_models.load`` (the server's loader is this mapping of flags)."""
    import torch

    import omni_models
    from omni_server.startup import load_options, lora_error, lora_options

    device = torch.device(config.resolved_device())
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    options = {**load_options(config), "lora": lora_options(config), **overrides}
    pipeline = omni_models.load(config.model, device=device, dtype=dtype, **options)
    logger.info("loaded %s (%s, %s) on %s", config.model, pipeline.info.family, pipeline.info.variant, device)
    for module in config.lora_modules:  # checked at start already (check_startup); an error here stops the start
        try:
            pipeline.lora.register(module.name, module.path)
        except omni_models.LoRAError as exc:
            raise lora_error(module.name, exc) from None
    return pipeline


def build_engine(config: ServerConfig) -> EngineCore:
    """Load the model (or start the worker group on several ranks), then build, size and warm up the engine."""
    requested_memory = None
    if not config.kv_cache_memory_bytes and config.resolved_device().startswith("cuda"):
        # The memory target is fixed before the weights load, so the profile sees them as non-KV memory.
        from diffusion_kv import requested_device_memory

        requested_memory = requested_device_memory(config.resolved_device(), config.gpu_memory_utilization)
    if config.world_size > 1:
        from omni_server.workers import WorkerGroup

        pipeline = WorkerGroup.start(config)  # rank 0 of one process per GPU; the scheduler stays here
    else:
        pipeline = load_pipeline(config)
    return EngineCore(pipeline, config, requested_memory=requested_memory if pipeline.info.paged_kv else None)


__all__ = [
    "EngineCore",
    "Timer",
    "build_engine",
    "encode_output",
    "forward_isolating_failures",
    "load_pipeline",
    "request_error",
]
