"""The worker group: one process per GPU serving one request on several ranks (CFG-parallel, Ulysses SP, DLO
AllGather), started by the engine itself over ``torch.distributed`` (NCCL on CUDA, gloo on CPU; no torchrun).

Roles. The engine process is rank 0: it keeps the scheduler, the KV block bookkeeping and the row table, and it
runs its share of every forward. Ranks 1..N-1 are worker processes (``python -m omni_server.workers``) that
load the same model and run their share. The engine sees one pipeline, ``DistributedPipeline``: each call that
touches model state is first broadcast to the workers over a gloo control group (``broadcast_object_list``),
then run on rank 0; every rank runs the same calls in the same order, so their collectives match. What a
worker needs to mirror rank 0 travels with the calls: the prepare arguments of each new job (seed resolved),
the row table's installs and retires since the last forward (``JournaledRowTable``), and which jobs are still
alive. Every rank advances every job identically, so only rank 0 decodes.

Faults. A worker that exits while the group runs is fatal: the monitor thread kills the other workers and ends
the engine process at once (exit 1), so the API process sees the engine die (``/health`` 503, in-flight
requests 503) even while rank 0 is blocked inside a collective; workers die with the engine through
``PR_SET_PDEATHSIG``. An exception on any rank after a call was broadcast is fatal the same way (the ranks'
collectives no longer match); a request's ``InvalidRequestError`` is raised on every rank before any
collective and is not. ``close`` stops the workers cleanly (each exits 0), then kills what did not exit.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import inspect
import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import msgspec
from diffusion_kv import WorkerRowTable

from omni_server.config import ConfigError, ServerConfig
from omni_server.protocol import SEED_DRAW_RANGE

logger = logging.getLogger("omni_server.workers")

_PR_SET_PDEATHSIG = 1
_STORE_TIMEOUT = timedelta(seconds=300)
# The control group waits for the next call for as long as the server idles.
_CONTROL_TIMEOUT = timedelta(days=3650)
_STOP_TIMEOUT_S = 10.0


# -- start-up checks ---------------------------------------------------------------------------------------------


def check_parallel_config(config: ServerConfig, *, serving: bool = True) -> None:
    """Fail before anything starts (``ConfigError`` naming the flag) when the world cannot run this model here.

    ``serving``: the checks of ``serve`` (whose engine runs the causal-prefix DiT on several GPUs); ``generate``
    also runs the diffusers families on several GPUs (CFG-parallel: FLUX.1 and Qwen-Image; SP: FLUX.1).
    """
    if config.world_size == 1:
        return
    check_devices(config)
    family, num_heads = _model_heads(config.model)
    if family is not None:
        if serving:
            raise ConfigError(
                "--cfg-parallel-size and --sequence-parallel-size: omni-server serve runs the causal-prefix DiT on "
                f"several GPUs; {config.model!r} is a diffusers {family} checkpoint, which `omni-server generate` "
                "runs on several GPUs (serve it on one)"
            )
        if config.sequence_parallel_size > 1 and family != "flux":
            raise ConfigError(f"--sequence-parallel-size applies to FLUX.1 among the families, not {family}; use "
                              "--cfg-parallel-size")
        if config.enable_layerwise_offload or config.quantization:
            raise ConfigError("--enable-layerwise-offload and --quantization are not combined with several GPUs for "
                              "the diffusers families yet; drop them or the parallel flags")
    from omni_models.parallel import check_sequence_parallel

    try:
        check_sequence_parallel(num_heads, config.sequence_parallel_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_devices(config: ServerConfig) -> None:
    """On CUDA, one rank per visible GPU: ``ConfigError`` naming the flags unless the counts agree."""
    world = config.world_size
    device = config.resolved_device()
    if world == 1 or not device.startswith("cuda"):
        return
    import torch

    available = torch.cuda.device_count()
    if available != world:
        raise ConfigError(
            f"--cfg-parallel-size {config.cfg_parallel_size} x --sequence-parallel-size "
            f"{config.sequence_parallel_size} = {world} ranks, but {available} CUDA device(s) are visible; "
            f"one rank runs per GPU, so make CUDA_VISIBLE_DEVICES list exactly {world}"
        )
    if device != "cuda":
        raise ConfigError(f"--device {device} names one GPU, but {world} ranks use one GPU each; pass --device cuda")


def _model_heads(model: str) -> tuple[str | None, int]:
    """(diffusers family or None for the causal-prefix DiT, attention heads), read from config files only."""
    import json

    from omni_models.checkpoint import load_config
    from omni_models.hub import is_diffusers_checkpoint, resolve_model_dir

    try:
        directory = resolve_model_dir(model)
    except Exception as exc:  # an unknown model is reported by the loader as usual; here it names the flags
        raise ConfigError(f"cannot check --sequence-parallel-size against model {model!r}: {exc}") from None
    if is_diffusers_checkpoint(directory):
        index = json.loads((directory / "model_index.json").read_text())
        family = "flux" if "Flux" in str(index.get("_class_name")) else "qwen-image"
        transformer = json.loads((directory / "transformer" / "config.json").read_text())
        return family, int(transformer["num_attention_heads"])
    config, _ = load_config(directory)
    return None, config.num_heads


# -- rank 0: the pipeline the engine drives ------------------------------------------------------------------------


class JournaledRowTable(WorkerRowTable):
    """The engine's row table, recording every install and retire so the workers can replay them in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_kwargs = dict(kwargs)
        self.journal: list[tuple[str, Any]] = []

    def install(self, metadata: Any) -> bool:
        written = super().install(metadata)
        self.journal.append(("install", metadata))
        return written

    def remove(self, targets: Any) -> int:
        targets = list(targets)
        removed = super().remove(targets)
        self.journal.append(("remove", targets))
        return removed

    def drain(self) -> list[tuple[str, Any]]:
        ops, self.journal = self.journal, []
        return ops


class _JobRecord:
    __slots__ = ("key", "arguments", "sent")

    def __init__(self, key: int, arguments: dict[str, Any]) -> None:
        self.key, self.arguments, self.sent = key, arguments, False


class DistributedPipeline:
    """Rank 0's pipeline: every state-changing call runs on all ranks (see the module docstring).

    Read-only attributes (``info``, ``device``, ``kv_caches``, ``decode``, ...) are the local pipeline's.
    """

    row_table_type = JournaledRowTable

    def __init__(self, local: Any, group: WorkerGroup) -> None:
        self._local = local
        self._group = group
        self._keys = itertools.count()
        self._jobs: weakref.WeakKeyDictionary[Any, _JobRecord] = weakref.WeakKeyDictionary()
        self._table: JournaledRowTable | None = None
        self._prepare_signature = inspect.signature(local.prepare)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def local(self) -> Any:
        """Rank 0's own pipeline."""
        return self._local

    # -- calls mirrored on every rank ------------------------------------------------------------------------

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """Validate and build the job on rank 0 only; the workers build it from the same arguments when it first
        runs (the random seed is drawn here, so every rank starts from the same noise)."""
        bound = self._prepare_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if arguments.get("seed") is None:
            arguments["seed"] = random.SystemRandom().randrange(SEED_DRAW_RANGE)
        job = self._local.prepare(**arguments)
        self._jobs[job] = _JobRecord(next(self._keys), arguments)
        return job

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[Any]:
        self._table = None
        return self._run(("allocate", num_blocks, block_size), self._local.allocate_kv_caches, num_blocks, block_size)

    def bind_row_table(self, table: Any) -> None:
        if not isinstance(table, JournaledRowTable):
            raise TypeError("the engine's row table must be a DistributedPipeline.row_table_type so workers mirror it")
        table.drain()
        self._table = table
        self._run(("bind", table.init_kwargs), self._local.bind_row_table, table)

    def allocate_kv_caches_for(self, jobs: Sequence[Any], block_size: int) -> list[Any]:
        self._table = None
        entries = [self._entry(job, ()) for job in jobs]
        return self._run(("alloc_for", entries, block_size), self._local.allocate_kv_caches_for, jobs, block_size)

    def run_prefix(self, batch: Sequence[Any]) -> None:
        self._run(self._forward("prefix", batch), self._local.run_prefix, batch)

    def run_denoise_step(self, batch: Sequence[Any], **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"{sorted(kwargs)} are single-rank options; a multi-rank engine runs the default forward")
        self._run(self._forward("denoise", batch), self._local.run_denoise_step, batch)

    def __call__(self, prompt: Any, *args: Any, callback_on_step_end: Any = None, **kwargs: Any) -> Any:
        """One-call generation on every rank; the callback (progress) runs on rank 0 only."""
        from omni_models import InvalidRequestError

        if kwargs.get("seed") is None:
            kwargs["seed"] = random.SystemRandom().randrange(SEED_DRAW_RANGE)
        self._group.broadcast(("call", prompt, args, kwargs))
        try:
            return self._local(prompt, *args, callback_on_step_end=callback_on_step_end, **kwargs)
        except InvalidRequestError:
            raise  # raised on every rank before any collective: the group stays in step
        except BaseException as exc:
            self._group.fail(f"rank 0 failed inside a multi-rank call: {type(exc).__name__}: {exc}")
            raise

    def close(self) -> None:
        self._group.stop()

    # -- helpers ----------------------------------------------------------------------------------------------

    def _entry(self, job: Any, identities: Sequence[Any]) -> tuple[int, str | None, dict[str, Any] | None, tuple]:
        record = self._jobs.get(job)
        if record is None:
            raise ValueError("a job in a multi-rank batch must come from this pipeline's prepare()")
        arguments = None if record.sent else record.arguments
        record.sent = True
        return record.key, job.request_id, arguments, tuple(identities)

    def _forward(self, kind: str, batch: Sequence[Any]) -> tuple:
        ops = self._table.drain() if self._table is not None else []
        entries = [self._entry(scheduled.job, scheduled.rows) for scheduled in batch]
        live = [record.key for record in self._jobs.values()]
        return kind, ops, entries, live

    def _run(self, command: tuple, local: Any, *args: Any) -> Any:
        self._group.broadcast(command)
        try:
            return local(*args)
        except BaseException as exc:
            self._group.fail(f"rank 0 failed inside a multi-rank {command[0]!r} call: {type(exc).__name__}: {exc}")
            raise


# -- the group -----------------------------------------------------------------------------------------------------


def _rank_config(config: ServerConfig, rank: int) -> ServerConfig:
    device = config.resolved_device()
    return msgspec.structs.replace(config, device=f"cuda:{rank}" if device.startswith("cuda") else "cpu")


def _backend(config: ServerConfig) -> str:
    return "nccl" if config.resolved_device().startswith("cuda") else "gloo"


def _init_rank(config: ServerConfig, rank: int, store: Any) -> tuple[Any, Any, Any]:
    """Join WORLD, build the control group and the CFG/SP groups, load this rank's pipeline."""
    import torch
    import torch.distributed as dist

    from omni_models.families import FamilyPipeline
    from omni_models.parallel import enable_parallel, init_parallel
    from omni_server.loader import load_pipeline

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    rank_config = _rank_config(config, rank)
    if rank_config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(config), store=store, rank=rank, world_size=config.world_size,
                            timeout=_STORE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    state = init_parallel(cfg_parallel_size=config.cfg_parallel_size,
                          sequence_parallel_size=config.sequence_parallel_size)
    pipeline = load_pipeline(rank_config)
    if isinstance(pipeline, FamilyPipeline):
        from omni_models.family_parallel import enable_family_parallel

        enable_family_parallel(pipeline, state)
    else:
        enable_parallel(pipeline, state)
    dist.barrier(group=control)  # every rank loaded: the group is ready
    return pipeline, control, state


class WorkerGroup:
    """Rank 0's handle on the worker processes: start, broadcast calls, watch, stop."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.world_size = config.world_size
        self._procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()  # no worker exit is a fault any more (clean stop or failure)
        self._fail_lock = threading.Lock()
        self._failing = False
        self._control: Any = None

    @classmethod
    def start(cls, config: ServerConfig) -> DistributedPipeline:
        """Spawn ranks 1..N-1, join them as rank 0 and return the engine's pipeline."""
        import torch.distributed as dist

        check_devices(config)  # also when the engine is built without the CLI
        group = cls(config)
        store = dist.TCPStore("127.0.0.1", 0, config.world_size, is_master=True, timeout=_STORE_TIMEOUT,
                              wait_for_workers=False)
        payload = base64.b64encode(msgspec.msgpack.encode(config)).decode("ascii")
        env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        for rank in range(1, config.world_size):
            group._procs.append(subprocess.Popen(
                [sys.executable, "-m", "omni_server.workers", "--rank", str(rank), "--port", str(store.port),
                 "--parent-pid", str(os.getpid()), "--config", payload],
                env=env, stdin=subprocess.DEVNULL,
            ))
        for rank, proc in enumerate(group._procs, start=1):
            threading.Thread(target=group._watch, args=(rank, proc), name=f"omni-worker-{rank}-watch",
                             daemon=True).start()
        try:
            pipeline, group._control, _state = _init_rank(config, 0, store)
        except BaseException as exc:
            group.fail(f"rank 0 failed to start the worker group: {type(exc).__name__}: {exc}", exit_process=False)
            raise
        logger.info("worker group ready: %d ranks (cfg %d x sp %d, %s), worker pids %s", config.world_size,
                    config.cfg_parallel_size, config.sequence_parallel_size, _backend(config),
                    [p.pid for p in group._procs])
        return DistributedPipeline(pipeline, group)

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def broadcast(self, command: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self._control)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping.is_set():
            self.fail(f"worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def fail(self, reason: str, *, exit_process: bool = True) -> None:
        """The group is broken: kill every worker, then (by default) end this process so the server sees it.

        Only the first caller acts; a later one (the watcher and rank 0's failed collective race) blocks until
        the first ends the process, so no request is answered as if the engine lived on.
        """
        with self._fail_lock:
            first = not self._failing
            self._failing = True
            self._stopping.set()
        if not first:
            if exit_process:
                threading.Event().wait()
            return
        logger.error("worker group failed: %s; stopping every rank", reason)
        self._kill_workers()
        if exit_process:
            logging.shutdown()
            os._exit(1)

    def _kill_workers(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not exit after SIGKILL", proc.pid)

    def stop(self) -> None:
        """Ask every worker to exit, wait for them (bounded), kill stragglers, leave the process group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        import torch.distributed as dist

        try:
            self.broadcast(("stop",))
        except Exception:
            logger.exception("could not send stop to the workers")
        for proc in self._procs:
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not stop within %.0f s; killing it", proc.pid, _STOP_TIMEOUT_S)
        self._kill_workers()
        logger.info("worker group stopped: worker exit codes %s", [proc.returncode for proc in self._procs])
        from dlo_offload import destroy_model_parallel

        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- ranks 1..N-1 ----------------------------------------------------------------------------------------------------


class _WorkerState:
    """A worker's mirror of rank 0: its pipeline, the jobs by key, the engine's row table."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.jobs: dict[int, Any] = {}
        self.table: WorkerRowTable | None = None

    def _job(self, key: int, request_id: str | None, arguments: dict[str, Any] | None) -> Any:
        if arguments is not None:
            job = self.pipeline.prepare(**arguments)
            job.request_id = request_id
            self.jobs[key] = job
        return self.jobs[key]

    def _batch(self, entries: Sequence[tuple]) -> list[Any]:
        from omni_models import ScheduledJob

        return [ScheduledJob(self._job(key, request_id, arguments), identities)
                for key, request_id, arguments, identities in entries]

    def handle(self, command: tuple) -> bool:
        """Run one call; False when told to stop."""
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "allocate":
            self.table = None
            self.pipeline.allocate_kv_caches(command[1], command[2])
        elif kind == "bind":
            self.table = WorkerRowTable(**command[1])
            self.pipeline.bind_row_table(self.table)
        elif kind == "alloc_for":
            self.table = None
            jobs = [self._job(key, request_id, arguments) for key, request_id, arguments, _ in command[1]]
            self.pipeline.allocate_kv_caches_for(jobs, command[2])
        elif kind in ("prefix", "denoise"):
            _, ops, entries, live = command
            for op, argument in ops:
                getattr(self.table, op)(argument)
            batch = self._batch(entries)
            alive = set(live)
            self.jobs = {key: job for key, job in self.jobs.items() if key in alive}
            if kind == "prefix":
                self.pipeline.run_prefix(batch)
            else:
                self.pipeline.run_denoise_step(batch)
        elif kind == "call":
            from omni_models import InvalidRequestError

            _, prompt, args, kwargs = command
            try:
                self.pipeline(prompt, *args, **kwargs)
            except InvalidRequestError:
                pass  # rank 0 raised the same error before any collective and reports it
        else:
            raise RuntimeError(f"unknown worker command {kind!r}")
        return True


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the engine died before prctl took effect
        os._exit(1)


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_server.workers",
                                     description="One rank of omni-server's worker group (started by the engine).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="base64 msgpack ServerConfig")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers; Ctrl-C reaches it
    config = msgspec.msgpack.decode(base64.b64decode(args.config), type=ServerConfig)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [worker {args.rank}] %(message)s")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", args.port, config.world_size, is_master=False, timeout=_STORE_TIMEOUT)
    pipeline, control, _state = _init_rank(config, args.rank, store)
    worker = _WorkerState(pipeline)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if not worker.handle(box[0]):
            break
    from dlo_offload import destroy_model_parallel

    destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
