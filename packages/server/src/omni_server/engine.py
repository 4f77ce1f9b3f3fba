"""One engine core for every model kind: requests become jobs, jobs advance in batched steps, outputs come back.

``EngineCore`` drives any ``omni_models.StepwisePipeline`` (``omni_models.contract``); what differs by kind is
the strategy (``omni_server.strategies``: paged KV admission for the shipped DiT, FIFO for the rest). Each
iteration (``step``):

1. the strategy schedules: admits waiting requests and returns the running ones;
2. ONE forward for the jobs it selects (``--max-rows-per-step``), whatever request or step index each is at:
   first ``pipeline.start`` for jobs that have not started (prompt encoding, prefix K/V, AR rows), then
   ``pipeline.step``. With ``--batch-invariant`` each job runs in a forward of its own. A forward that raises is
   run again one request at a time, so only the culprit fails (``forward_isolating_failures``);
3. requests whose jobs all finished are decoded together (``pipeline.decode``); their files (PNG, WAV, MP4) are
   encoded on a thread pool (``encode_output``), off the loop, while the next iterations' forwards run;
4. the strategy reports every request that ended (completed: its files encoded; aborted; failed); each gets its
   one ``RequestFinished`` and ``pipeline.release`` frees what the pipeline held for it.

Start-up runs a warm-up request through every path; when that compiled graphs (a pipeline loaded with
``compile=True``), every size the model lists is warmed up too, with one row and with two (``omni_models.
compilation.warmup_shapes``; two only where two images share a forward under ``--max-batched-image-tokens``), so
that serving compiles nothing more. ``EngineStats`` reports the graphs compiled
so far and those compiled since ready (``/metrics``).

LoRA adapters are registered with the pipeline (``pipeline.lora``, ``omni_models.lora``) at load and by
``update_lora`` between iterations; a request names one and its jobs hold it until released.

Invariant: each added request produces exactly one ``RequestFinished`` (outputs or an error, an abort included),
and an error in one request never stops the loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from omni_models import GenerationRequest, ModelInfo, ResolvedRequest, StepwisePipeline
from omni_models.step_cache import StepCacheStats
from omni_server.config import ConfigError, ServerConfig
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

if TYPE_CHECKING:
    from omni_models.lora import LoRARuntime

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
        self,
        request_id: str,
        *,
        outputs: Iterable[bytes] = (),
        error: RequestError | None = None,
        step_cache: Iterable[StepCacheStats] = (),
    ) -> RequestFinished:
        now = time.monotonic()
        scheduled = self.scheduled if self.scheduled is not None else now
        return RequestFinished(
            request_id=request_id,
            outputs=list(outputs),
            error=error,
            queue_s=scheduled - self.arrival,
            engine_s=now - self.arrival,
            step_cache=list(step_cache),
        )


# zlib level 1, not PIL's 6: on the 2-core development machine a smooth 1024^2 image took 43 ms instead of 69 ms (its
# file 30 KB instead of 9 KB), a noise image 268 ms instead of 328 ms (3 MB either way). A request waits for its PNG,
# so it is deflated on several threads too (omni_server.png).
PNG_COMPRESS_LEVEL = 1


def encode_output(output: object, *, video_crf: int | None = None) -> bytes:
    """The file an output travels as: PNG for an image, WAV for a song, MP4 for a video (``omni_models.Video``:
    H.264 at its ``fps``, ``video_crf`` its quality, ``omni_server.video_io``)."""
    wav = getattr(output, "wav", None)
    if wav is not None:
        return wav()
    frames = getattr(output, "frames", None)
    if frames is not None:
        from omni_server.video_io import DEFAULT_CRF, encode_mp4

        return encode_mp4(frames, output.fps, crf=DEFAULT_CRF if video_crf is None else video_crf)
    from omni_server.png import encode_png

    return encode_png(output, level=PNG_COMPRESS_LEVEL)


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
    """The cheapest valid request of a model at a size it serves: the engine runs it through every path before
    reporting ready.

    The smallest *served* size, not the smallest accepted one: a compiled family's first forward fixes what its
    graphs specialize on, and at the smallest accepted side (16 on FLUX.1: one image token) the sequence length is
    1, a value dynamo specializes; no served request reuses those graphs (on FLUX.1-Kontext the next warm-up
    request compiled both block classes again). Under Ulysses SP a family's image tokens must split evenly over
    the ranks: the side of a size range is then ``sequence_parallel_size`` times its smallest (``sp**2`` tokens of
    2x2 latent patches)."""
    from omni_models import GenerationRequest

    if info.audio is not None:
        return GenerationRequest(prompt="warm up", lyrics="la", max_new_tokens=2, seed=0)
    height, width = info.image.smallest_listed_size()
    rule = info.image.size_range
    if rule is not None and sequence_parallel_size > 1:
        height = width = min(rule.min_side * sequence_parallel_size, rule.max_side)
    word = info.vocabulary[0] if info.vocabulary else "warm up"
    frames = {"num_frames": 1} if info.video is not None else {}  # a video model: its shortest clip
    return GenerationRequest(
        prompt=word, height=height, width=width, num_inference_steps=2, seed=0, images=_warmup_images(info), **frames
    )


def _warmup_images(info: ModelInfo) -> tuple:
    """The input images an edit-only model needs in a warm-up request: grey, at its smallest size."""
    from omni_models import InputImage

    assert info.image is not None
    height, width = info.image.smallest_size()
    grey = InputImage(width=width, height=height, pixels=bytes([128]) * (width * height * 3))
    return (grey,) * info.image.min_input_images


def compiled_warmup_requests(info: ModelInfo, config: ServerConfig) -> list[GenerationRequest]:
    """For a compiled model: a 2-step request per (rows, size) of ``omni_models.compilation.warmup_shapes`` at each
    size the model lists, so every graph serving needs is compiled before the engine reports ready."""
    from omni_models import GenerationRequest
    from omni_models.compilation import warmup_shapes

    if info.image is None:
        return []
    max_rows = config.max_rows_per_step or info.image.max_images_per_request
    max_rows = 1 if config.batch_invariant else min(max_rows, info.image.max_images_per_request)
    word = info.vocabulary[0] if info.vocabulary else "warm up"
    frames = {"num_frames": 1} if info.video is not None else {}
    # One row: one image without CFG (guidance 1 turns true CFG off); more rows: that many images, guided or not.
    return [
        GenerationRequest(
            prompt=word,
            height=height,
            width=width,
            n=rows,
            num_inference_steps=2,
            seed=0,
            guidance_scale=1.0 if rows == 1 else None,
            **frames,
            images=_warmup_images(info),
        )
        for rows, (height, width) in warmup_shapes(info.image.sizes, max_rows=max_rows)
    ]


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (0 when nothing imported it)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from omni_models.compilation import compile_count

    return compile_count()


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
        # Requests decoded and being encoded: their files, one future each (``_complete``).
        self._encoding: dict[str, list[concurrent.futures.Future[bytes]]] = {}
        self._encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-encode")
        self._pid = os.getpid()
        self._graphs_at_ready = compiled_graphs()
        if config.warmup:
            self._warm_up()
        self._graphs_at_ready = compiled_graphs()

    def _warm_up(self) -> None:
        """One real request through every engine path (admit, start, step, decode, free); if that compiled
        anything, one per served shape as well (``compiled_warmup_requests``), and with LoRA on, all of them again
        through the LoRA path (``LoRARuntime.warming``: a forward with an adapter runs other graphs than one
        without)."""
        before = compiled_graphs()
        started = time.monotonic()
        first = warmup_request(self.info, self._config.sequence_parallel_size)
        self._run_warmup([first])
        # A compiled family runs its served shapes even when the first request compiled nothing: under torch's
        # caching precompile (opt-in) its graphs can come from the compile cache, and running them now keeps any
        # that do not fit out of serving.
        if compiled_graphs() > before or getattr(self.pipeline, "compiled", None) is not None:
            from omni_models.compilation import precompiled_count

            first_s, started = time.monotonic() - started, time.monotonic()
            requests = [r for r in compiled_warmup_requests(self.info, self._config) if self._shares_forwards(r)]
            self._run_warmup(requests)
            count = len(requests)
            lora = getattr(self.pipeline, "lora", None)
            if lora is not None:  # the same shapes through the graphs with the LoRA ops (a zero delta)
                with lora.warming():
                    self._run_warmup([first, *requests])
                count += 1 + len(requests)
            logger.info(
                "compiled warm-up: the first request in %.1f s, %d more in %.1f s; %d graphs compiled in all, "
                "%d functions loaded precompiled",
                first_s,
                count,
                time.monotonic() - started,
                compiled_graphs(),
                precompiled_count(),
            )
            self._save_compile_cache()
        self._step_latencies.clear()

    @staticmethod
    def _save_compile_cache() -> None:
        """After a warm-up that compiled: where the compile went (dynamo's phases) and, under torch's caching
        precompile (``TORCH_CACHING_PRECOMPILE=1``, opt-in), what it compiled written to the compile cache, so that
        the next start loads it instead of tracing."""
        from omni_models.compilation import compile_times, save_compile_cache

        if compiled_graphs() == 0:
            return
        logger.info("compile time by phase (s): %s", ", ".join(f"{n} {t:.1f}" for n, t in compile_times()))
        started = time.monotonic()
        try:
            saved = save_compile_cache()
        except Exception as exc:  # an experimental torch feature: the next start compiles again, nothing worse
            logger.warning("compile cache: could not save the precompiled functions (%s: %s)", type(exc).__name__, exc)
            return
        if saved:
            logger.info("compile cache: %d functions saved precompiled in %.1f s", saved, time.monotonic() - started)

    def _shares_forwards(self, request: GenerationRequest) -> bool:
        """Whether a warm-up request's images would share a forward: under the family's image-token budget
        (``FamilyPipeline.forward_parts``) several images at a large size run one per forward, compiling nothing the
        one-image request did not."""
        from omni_models import resolve_request

        forward_parts = getattr(self.pipeline, "forward_parts", None)
        if request.n == 1 or forward_parts is None:
            return True
        jobs = self.pipeline.prepare(resolve_request(self.info, request))
        try:
            return any(len(part) > 1 for part in forward_parts(jobs))
        finally:
            self.pipeline.release(jobs)

    def _run_warmup(self, requests: Sequence[GenerationRequest]) -> None:
        from omni_models import resolve_request

        for index, request in enumerate(requests):
            request_id = f"warmup-{index}"
            self.add(request_id, resolve_request(self.info, request))
            outputs: list[EngineOutput] = []
            while not any(isinstance(o, RequestFinished) and o.request_id == request_id for o in outputs):
                outputs += self.step()
            finished = next(o for o in outputs if isinstance(o, RequestFinished) and o.request_id == request_id)
            if finished.error is not None:
                raise RuntimeError(f"warm-up request failed: {finished.error.message}")

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
        stepping = [r for r in self._running if not r.finished]
        if stepping:
            started = time.monotonic()
            forward_isolating_failures(stepping, self._forward, self._fail_forward)
            self._step_latencies.append(time.monotonic() - started)
        self._complete(
            [
                r
                for r in self._running
                if r.finished and r.request_id not in self._failing and r.request_id not in self._encoding
            ]
        )
        if self._encoding and all(r.finished for r in self._running):
            # No running request has a step left: nothing to overlap the encodes with but admitting a waiting
            # request, so wait for all of them (or, with requests waiting, for the next to finish, rather than
            # spin). Only the files still encoding count: a request half encoded has finished futures, and waiting
            # for the "first completed" of those returns at once, every iteration.
            pending = [f for futures in self._encoding.values() for f in futures if not f.done()]
            if self._strategy.occupancy().waiting:
                concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                concurrent.futures.wait(pending)
        completed = self._encoded()
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

    def _complete(self, finished: Sequence[EngineRequest]) -> None:
        """Decode every finished request together (on failure, one at a time: only the culprit fails) and queue
        its outputs' encoding on the encoder threads."""
        if not finished:
            return
        try:
            decoded = self.pipeline.decode([job for request in finished for job in request.jobs])
        except Exception as exc:
            if len(finished) == 1:
                logger.exception("decoding request %s failed", finished[0].request_id)
                self._fail(finished[0], exc)
                return
            for request in finished:
                self._complete([request])
            return
        offset = 0
        for request in finished:
            outputs = decoded[offset : offset + len(request.jobs)]
            self._encoding[request.request_id] = [
                self._encoder.submit(encode_output, out, video_crf=self._config.video_crf) for out in outputs
            ]
            offset += len(request.jobs)

    def _encoded(self) -> list[str]:
        """The requests whose every file is encoded (their ``outputs`` set); a failed encode fails its request."""
        completed = []
        requests = {r.request_id: r for r in self._running}
        for request_id, futures in list(self._encoding.items()):
            if not all(future.done() for future in futures):
                continue
            del self._encoding[request_id]
            request = requests.get(request_id)
            if request is None:  # ended meanwhile (aborted)
                continue
            errors = [future.exception() for future in futures if future.exception() is not None]
            if errors:
                logger.error("encoding request %s failed", request_id, exc_info=errors[0])
                self._fail(request, errors[0])
                continue
            request.outputs = [future.result() for future in futures]
            completed.append(request_id)
        return completed

    def _report(self, ended: Ended) -> RequestFinished:
        request = ended.request
        self._live.discard(request.request_id)
        self._failing.discard(request.request_id)
        self._encoding.pop(request.request_id, None)
        try:
            self.pipeline.release(request.jobs)
        except Exception:  # a release that fails must not take the request's answer or the loop with it
            logger.exception("releasing request %s failed", request.request_id)
        if ended.outcome == "completed":
            caches = [getattr(job, "step_cache", None) for job in request.jobs]
            stats = [cache.stats() for cache in caches if cache is not None]
            return request.timer.finished(request.request_id, outputs=request.outputs, step_cache=stats)
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
            compiled_graphs=(graphs := compiled_graphs()),
            recompiles_since_ready=graphs - self._graphs_at_ready,
            progress=[
                StepProgress(r.request_id, r.jobs[0].step_index, r.jobs[0].num_steps)
                for r in self._running
                if r.jobs and r.request_id in self._live
            ],
        )

    def close(self) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)
        self._encoding.clear()
        self._strategy.close()
        self._live.clear()
        self.pipeline.close()


def load_pipeline(config: ServerConfig, **overrides: object) -> StepwisePipeline:
    """The configured model through ``omni_models.load`` (the server's loader is this mapping of flags)."""
    import torch

    import omni_models
    from omni_server.startup import load_options, lora_options, serving_options

    device = torch.device(config.resolved_device())
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    options = {
        **load_options(config),
        **serving_options(config, omni_models.inspect(config.model)),
        "lora": lora_options(config),
        **overrides,
    }
    pipeline = omni_models.load(config.model, device=device, dtype=dtype, **options)
    logger.info(
        "loaded %s (%s, %s) on %s, %s",
        config.model,
        pipeline.info.family,
        pipeline.info.variant,
        device,
        "compiled" if options["compile"] else "eager",
    )
    lora = getattr(pipeline, "lora", None)  # the diffusers families' (with --enable-lora); other kinds have none
    if lora is not None:
        register_lora_modules(config, lora)
    return pipeline


def register_lora_modules(config: ServerConfig, lora: LoRARuntime) -> None:
    """Register ``--lora-modules`` and choose the linears LoRA applies to (before anything compiles): those of
    ``--lora-target-modules``; without it, when adapters cannot be loaded at run time, the linears the start
    adapters hold (the only adapters this server will serve), so no other linear launches a LoRA op."""
    import omni_models
    from omni_models.lora import select_targets
    from omni_server.startup import lora_error

    if config.lora_target_modules is not None:
        try:
            lora.restrict(select_targets(lora.linears, config.lora_target_modules))
        except ValueError as exc:
            raise ConfigError(f"--lora-target-modules: {exc}") from None
    for module in config.lora_modules:  # checked at start already (check_startup); an error here stops the start
        try:
            lora.register(module.name, module.path)
        except omni_models.LoRAError as exc:
            raise lora_error(module.name, exc) from None
    if config.lora_target_modules is None and config.lora_modules and not config.allow_runtime_lora_updating:
        lora.restrict(sorted(lora.registered_layers()))
    logger.info("LoRA applies to %d of the transformer's %d linears", len(lora.targets), len(lora.linears))


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
