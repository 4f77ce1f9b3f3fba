"""Prometheus metrics of one server, in their own registry (several apps can live in one process).

Names follow vLLM's ``vllm:`` convention with an ``omni:`` prefix. Gauges mirror
the engine's latest ``EngineStats`` (zeroed when the engine dies: its requests and blocks are gone);
``omni:engine_ready`` and ``omni:engine_heartbeat_age_seconds`` are read at scrape time; histograms are
observed as requests finish (video jobs count as requests: ``omni:request_finished`` and the latency histograms
include them; ``omni:video_jobs`` and ``omni:video_storage_bytes`` say what the videos API holds).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omni_server.protocol import EngineStats, RequestFinished

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.running = Gauge(
            "omni:num_requests_running", "Requests admitted by the scheduler and executing.", ["model_name"], registry=r
        ).labels(**labels)
        self.waiting = Gauge(
            "omni:num_requests_waiting", "Requests queued for KV admission.", ["model_name"], registry=r
        ).labels(**labels)
        self.kv_blocks_used = Gauge(
            "omni:kv_cache_blocks_in_use", "KV cache blocks currently reserved.", ["model_name"], registry=r
        ).labels(**labels)
        self.kv_blocks_total = Gauge(
            "omni:kv_cache_blocks_total", "KV cache blocks in the pool.", ["model_name"], registry=r
        ).labels(**labels)
        self.engine_ready = Gauge(
            "omni:engine_ready",
            "1 when the engine is ready, 0 while starting or after it died.",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.queue_time = Histogram(
            "omni:request_queue_time_seconds",
            "Arrival to first scheduled, in the engine.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.step_time = Histogram(
            "omni:denoise_step_latency_seconds",
            "Wall time of one engine denoising iteration.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.e2e_time = Histogram(
            "omni:e2e_request_latency_seconds",
            "HTTP request received to response ready.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.heartbeat_age = Gauge(
            "omni:engine_heartbeat_age_seconds",
            "Seconds since the engine process was last heard from.",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.compiled_graphs = Gauge(
            "omni:compiled_graphs",
            "Graphs torch.compile compiled in the engine process (warm-up included).",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.recompiles = Gauge(
            "omni:recompiles_since_ready",
            "Graphs torch.compile compiled after the engine reported ready (0 in steady serving).",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.engine_restarts = Counter(
            "omni:engine_restarts",
            "Engine processes restarted after the engine died.",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self._finished = Counter(
            "omni:request_finished", "Finished requests by outcome.", ["model_name", "outcome"], registry=r
        )
        self.step_cache_steps = Counter(
            "omni:step_cache_steps",
            "Denoising steps of images with a step cache, by decision (computed: the middle blocks ran; cached: the "
            "cached residual was reused).",
            ["model_name", "decision"],
            registry=r,
        )
        self.step_cache_block_fraction = Histogram(
            "omni:step_cache_block_fraction",
            "Per image with a step cache: repeated-block evaluations run over an uncached image's (FLOP fraction).",
            ["model_name"],
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        ).labels(**labels)
        self.video_jobs = Gauge(
            "omni:video_jobs",
            "Video jobs by status: queued and in_progress (unfinished), completed and failed (kept in --video-dir).",
            ["model_name", "status"],
            registry=r,
        )
        self.video_storage_bytes = Gauge(
            "omni:video_storage_bytes", "MP4 bytes kept in --video-dir.", ["model_name"], registry=r
        ).labels(**labels)
        self._model_name = model_name

    def observe_step_cache(self, finished: RequestFinished) -> None:
        for stats in finished.step_cache:
            computed = self.step_cache_steps.labels(model_name=self._model_name, decision="computed")
            computed.inc(stats.computed_steps)
            cached = self.step_cache_steps.labels(model_name=self._model_name, decision="cached")
            cached.inc(stats.num_steps - stats.computed_steps)
            self.step_cache_block_fraction.observe(stats.block_fraction)

    def observe_videos(self, counts: dict[str, int], stored_bytes: int) -> None:
        for status, count in counts.items():
            self.video_jobs.labels(model_name=self._model_name, status=status).set(count)
        self.video_storage_bytes.set(stored_bytes)

    def count_finished(self, outcome: str) -> None:
        """``outcome`` is one of success, invalid, error, aborted, unavailable, rejected (queue full), timeout."""
        self._finished.labels(model_name=self._model_name, outcome=outcome).inc()

    def update_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.compiled_graphs.set(stats.compiled_graphs)
        self.recompiles.set(stats.recompiles_since_ready)
        for latency in stats.step_latencies_s:
            self.step_time.observe(latency)

    def observe_engine(self, *, ready: bool, heartbeat_age_s: float) -> None:
        """Scrape-time truth: never a stale ``ready`` from before a death or a stall."""
        self.engine_ready.set(1 if ready else 0)
        self.heartbeat_age.set(heartbeat_age_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
