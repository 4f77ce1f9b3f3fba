"""The worker group: one process per GPU serving one request on several ranks (CFG-parallel, Ulysses SP, DLO
AllGather), started by the engine itself over ``torch.distributed`` (NCCL on CUDA, gloo on CPU; no torchrun).

Roles. The engine process is rank 0: it keeps the scheduler, the KV block bookkeeping and the row table, and it
runs its share of every forward. Ranks 1..N-1 are worker processes (``python -m omni_server.workers``) that load
the same model and run their share. The engine sees one pipeline, ``DistributedPipeline``, which implements the
stepwise contract (``omni_models.contract``) explicitly: each call that touches model state is first broadcast to
the workers over a gloo control group as a tagged ``msgspec`` command (``Command``), then run on rank 0; every rank
runs the same calls in the same order, so their collectives match. What a worker needs to mirror rank 0 travels
with the calls: each request's resolved fields (seed included) the first time one of its jobs runs, each job's KV
rows, the row table's installs and retires since the last forward (``JournaledRowTable``), and which requests are
still alive. Every rank advances every job identically, so only rank 0 decodes.

Faults. A worker that exits while the group runs is fatal: the monitor thread kills the other workers and ends the
engine process at once (exit 1), so the API process sees the engine die (``/health`` 503, in-flight requests 503)
even while rank 0 is blocked inside a collective; workers die with the engine through ``PR_SET_PDEATHSIG``. An
exception on any rank after a call was broadcast is fatal the same way (the ranks' collectives no longer match);
``prepare`` runs on rank 0 only and never reaches the workers when it refuses a request. ``close`` stops the
workers cleanly (each exits 0), then kills what did not exit.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from diffusion_kv import DiffusionKVMetadata, RowIdentity, WorkerRowTable
from omni_models import ResolvedRequest
from omni_server.config import ServerConfig

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Store

    from diffusion_kv import AttentionCacheSpec
    from omni_models import Job, PagedPipeline
    from omni_models.parallel import ParallelState

T = TypeVar("T")
logger = logging.getLogger("omni_server.workers")

_PR_SET_PDEATHSIG = 1
_STORE_TIMEOUT = timedelta(seconds=300)
# The control group waits for the next call for as long as the server idles.
_CONTROL_TIMEOUT = timedelta(days=3650)
_STOP_TIMEOUT_S = 10.0


# -- rank 0: the pipeline the engine drives ------------------------------------------------------------------------


class Install(msgspec.Struct, frozen=True, tag=True):
    metadata: DiffusionKVMetadata


class Remove(msgspec.Struct, frozen=True, tag=True):
    targets: list[str | tuple[str, int]]


RowOp = Install | Remove


class JournaledRowTable(WorkerRowTable):
    """The engine's row table, recording every install and retire so the workers can replay them in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.geometry = {name: kwargs[name] for name in ROW_TABLE_GEOMETRY}
        self.registered_roles = sorted(kwargs["registered_roles"])
        self.journal: list[RowOp] = []

    def install(self, metadata: DiffusionKVMetadata) -> bool:
        written = super().install(metadata)
        self.journal.append(Install(metadata))
        return written

    def remove(self, targets: Iterable[str | tuple[str, int]]) -> int:
        targets = list(targets)
        removed = super().remove(targets)
        self.journal.append(Remove(targets))
        return removed

    def drain(self) -> list[RowOp]:
        ops, self.journal = self.journal, []
        return ops


ROW_TABLE_GEOMETRY = ("num_rows", "max_rows_per_request", "num_blocks", "block_size", "max_model_len")


class JobRef(msgspec.Struct, frozen=True, array_like=True):
    """One job of a command: its request (``request`` is sent the first time any of the request's jobs runs), its
    index among the request's jobs, and its KV rows (paged pipelines)."""

    request_key: int
    index: int
    request_id: str | None = None
    request: ResolvedRequest | None = None
    kv_rows: tuple[RowIdentity, ...] | None = None


class AllocateKVCaches(msgspec.Struct, frozen=True, tag=True):
    num_blocks: int
    block_size: int


class BindRowTable(msgspec.Struct, frozen=True, tag=True):
    geometry: dict[str, int]
    registered_roles: list[str]


class AllocateKVCachesFor(msgspec.Struct, frozen=True, tag=True):
    jobs: list[JobRef]
    block_size: int


class Start(msgspec.Struct, frozen=True, tag=True):
    jobs: list[JobRef]
    row_ops: list[RowOp]
    live: list[int]  # the requests still alive: a worker forgets the others


class Step(msgspec.Struct, frozen=True, tag=True):
    jobs: list[JobRef]
    row_ops: list[RowOp]
    live: list[int]


class Stop(msgspec.Struct, frozen=True, tag=True):
    pass


Command = AllocateKVCaches | BindRowTable | AllocateKVCachesFor | Start | Step | Stop
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)


class _RequestRecord:
    __slots__ = ("key", "request", "request_id", "sent")

    def __init__(self, key: int, request: ResolvedRequest, request_id: str | None) -> None:
        self.key, self.request, self.request_id, self.sent = key, request, request_id, False


class DistributedPipeline:
    """Rank 0's pipeline: every state-changing call runs on all ranks (see the module docstring).

    It implements ``omni_models.contract.PagedPipeline`` (the paged calls are used when the model is paged):
    ``info``, ``device`` and ``decode`` are rank 0's own; ``prepare`` runs on rank 0 only, and a worker prepares the
    same request from its resolved fields when it first needs it.
    """

    row_table_type = JournaledRowTable

    def __init__(self, local: PagedPipeline, group: WorkerGroup) -> None:
        self.local = local
        self.info = local.info
        self.device = local.device
        self._group = group
        self._keys = itertools.count()
        self._requests: dict[int, _RequestRecord] = {}
        self._jobs: weakref.WeakKeyDictionary[Job, tuple[int, int]] = weakref.WeakKeyDictionary()
        self._table: JournaledRowTable | None = None

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    # -- the stepwise contract: mirrored on every rank ----------------------------------------------------------

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[Job]:
        jobs = self.local.prepare(request, request_id=request_id)
        key = next(self._keys)
        self._requests[key] = _RequestRecord(key, request, request_id)
        for index, job in enumerate(jobs):
            self._jobs[job] = (key, index)
        return jobs

    def start(self, jobs: Sequence[Job]) -> None:
        self._run(Start(self._refs(jobs), self._row_ops(), self._live()), self.local.start, jobs)

    def step(self, jobs: Sequence[Job]) -> None:
        self._run(Step(self._refs(jobs), self._row_ops(), self._live()), self.local.step, jobs)

    def decode(self, jobs: Sequence[Job]) -> list[object]:
        return self.local.decode(jobs)

    def step_cache_bytes(self, job: Job) -> int:
        """What ``job``'s step cache holds on each rank (rank 0's bound; the admission's ``StepCacheBudget``)."""
        return self.local.step_cache_bytes(job)

    def release(self, jobs: Sequence[Job]) -> None:
        """Rank 0 releases now; the workers forget the request with the next command's ``live`` list."""
        self.local.release(jobs)
        for job in jobs:
            entry = self._jobs.pop(job, None)
            if entry is not None:
                self._requests.pop(entry[0], None)

    def close(self) -> None:
        self._group.stop()

    # -- the paged KV pool ---------------------------------------------------------------------------------------

    def kv_cache_specs(self) -> dict[str, AttentionCacheSpec]:
        return self.local.kv_cache_specs()

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        self._table = None
        return self._run(
            AllocateKVCaches(num_blocks, block_size), self.local.allocate_kv_caches, num_blocks, block_size
        )

    def bind_row_table(self, table: WorkerRowTable) -> None:
        if not isinstance(table, JournaledRowTable):
            raise TypeError("the engine's row table must be a DistributedPipeline.row_table_type so workers mirror it")
        table.drain()
        self._table = table
        self._run(BindRowTable(table.geometry, table.registered_roles), self.local.bind_row_table, table)

    def allocate_kv_caches_for(self, jobs: Sequence[Job], block_size: int) -> None:
        self._table = None
        command = AllocateKVCachesFor(self._refs(jobs), block_size)
        self._run(command, self.local.allocate_kv_caches_for, jobs, block_size)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _refs(self, jobs: Sequence[Job]) -> list[JobRef]:
        refs = []
        for job in jobs:
            entry = self._jobs.get(job)
            if entry is None:
                raise ValueError("a job in a multi-rank call must come from this pipeline's prepare()")
            record = self._requests[entry[0]]
            first = not record.sent
            record.sent = True
            kv_rows = getattr(job, "kv_rows", None)
            refs.append(
                JobRef(
                    record.key,
                    entry[1],
                    record.request_id if first else None,
                    record.request if first else None,
                    None if kv_rows is None else tuple(kv_rows),
                )
            )
        return refs

    def _row_ops(self) -> list[RowOp]:
        return self._table.drain() if self._table is not None else []

    def _live(self) -> list[int]:
        return list(self._requests)

    def _run(self, command: Command, local: Callable[..., T], *args: object) -> T:
        self._group.broadcast(command)
        try:
            return local(*args)
        except BaseException as exc:
            self._group.fail(
                f"rank 0 failed inside a multi-rank {type(command).__name__} call: {type(exc).__name__}: {exc}"
            )
            raise


# -- the group -----------------------------------------------------------------------------------------------------


def _rank_config(config: ServerConfig, rank: int) -> ServerConfig:
    device = config.resolved_device()
    return msgspec.structs.replace(config, device=f"cuda:{rank}" if device.startswith("cuda") else "cpu")


def _backend(config: ServerConfig) -> str:
    return "nccl" if config.resolved_device().startswith("cuda") else "gloo"


def _init_rank(config: ServerConfig, rank: int, store: Store) -> tuple[PagedPipeline, ProcessGroup, ParallelState]:
    """Join WORLD, build the control group and the CFG/SP groups, load this rank's pipeline."""
    import torch
    import torch.distributed as dist

    from omni_models.parallel import init_parallel
    from omni_server.engine import load_pipeline

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    rank_config = _rank_config(config, rank)
    if rank_config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(
        _backend(config), store=store, rank=rank, world_size=config.world_size, timeout=_STORE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    state = init_parallel(
        cfg_parallel_size=config.cfg_parallel_size, sequence_parallel_size=config.sequence_parallel_size
    )
    pipeline = load_pipeline(rank_config, offload_group=state.offload_group if config.offload_allgather else None)
    pipeline.enable_parallel(state)
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
        self._control: ProcessGroup | None = None

    @classmethod
    def start(cls, config: ServerConfig) -> DistributedPipeline:
        """Spawn ranks 1..N-1, join them as rank 0 and return the engine's pipeline."""
        import torch.distributed as dist

        from omni_server.startup import check_devices

        check_devices(config)  # also when the engine is built without the CLI
        group = cls(config)
        store = dist.TCPStore(
            "127.0.0.1", 0, config.world_size, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
        payload = base64.b64encode(msgspec.msgpack.encode(config)).decode("ascii")
        env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        for rank in range(1, config.world_size):
            group._procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "omni_server.workers",
                        "--rank",
                        str(rank),
                        "--port",
                        str(store.port),
                        "--parent-pid",
                        str(os.getpid()),
                        "--config",
                        payload,
                    ],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )
        for rank, proc in enumerate(group._procs, start=1):
            threading.Thread(
                target=group._watch, args=(rank, proc), name=f"omni-worker-{rank}-watch", daemon=True
            ).start()
        try:
            pipeline, group._control, _state = _init_rank(config, 0, store)
        except BaseException as exc:
            group.fail(f"rank 0 failed to start the worker group: {type(exc).__name__}: {exc}", exit_process=False)
            raise
        logger.info(
            "worker group ready: %d ranks (cfg %d x sp %d, %s), worker pids %s",
            config.world_size,
            config.cfg_parallel_size,
            config.sequence_parallel_size,
            _backend(config),
            [p.pid for p in group._procs],
        )
        return DistributedPipeline(pipeline, group)

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def broadcast(self, command: Command) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([_ENCODER.encode(command)], src=0, group=self._control)

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
            self.broadcast(Stop())
        except Exception:
            logger.exception("could not send stop to the workers")
        for proc in self._procs:
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not stop within %.0f s; killing it", proc.pid, _STOP_TIMEOUT_S)
        self._kill_workers()
        logger.info("worker group stopped: worker exit codes %s", [proc.returncode for proc in self._procs])
        if dist.is_initialized():  # WORLD and every group built on it (the device mesh's, the control group)
            dist.destroy_process_group()


# -- ranks 1..N-1 ----------------------------------------------------------------------------------------------------


class _WorkerState:
    """A worker's mirror of rank 0: its pipeline, each live request's jobs, the engine's row table."""

    def __init__(self, pipeline: PagedPipeline) -> None:
        self.pipeline = pipeline
        self.requests: dict[int, list[Job]] = {}
        self.table: WorkerRowTable | None = None

    def _jobs(self, refs: Sequence[JobRef]) -> list[Job]:
        jobs = []
        for ref in refs:
            if ref.request is not None:
                self.requests[ref.request_key] = self.pipeline.prepare(ref.request, request_id=ref.request_id)
            job = self.requests[ref.request_key][ref.index]
            if ref.kv_rows is not None:
                job.kv_rows = ref.kv_rows
            jobs.append(job)
        return jobs

    def _replay(self, ops: Sequence[RowOp], live: Sequence[int]) -> None:
        for op in ops:
            match op:
                case Install(metadata):
                    self.table.install(metadata)
                case Remove(targets):
                    self.table.remove(targets)
        alive = set(live)
        self.requests = {key: jobs for key, jobs in self.requests.items() if key in alive}

    def handle(self, command: Command) -> bool:
        """Run one call; False when told to stop."""
        match command:
            case Stop():
                return False
            case AllocateKVCaches(num_blocks, block_size):
                self.table = None
                self.pipeline.allocate_kv_caches(num_blocks, block_size)
            case BindRowTable(geometry, roles):
                self.table = WorkerRowTable(**geometry, registered_roles=set(roles), device=self.pipeline.device)
                self.pipeline.bind_row_table(self.table)
            case AllocateKVCachesFor(refs, block_size):
                self.table = None
                self.pipeline.allocate_kv_caches_for(self._jobs(refs), block_size)
            case Start(refs, ops, live):
                self._replay(ops, live)
                self.pipeline.start(self._jobs(refs))
            case Step(refs, ops, live):
                self._replay(ops, live)
                self.pipeline.step(self._jobs(refs))
        return True


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the engine died before prctl took effect
        os._exit(1)


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_server.workers",
        description="One rank of omni-server's worker group (started by the engine).",
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="base64 msgpack ServerConfig")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers; Ctrl-C reaches it
    config = msgspec.msgpack.decode(base64.b64decode(args.config), type=ServerConfig)
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s %(levelname)s [worker {args.rank}] %(message)s"
    )
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", args.port, config.world_size, is_master=False, timeout=_STORE_TIMEOUT)
    pipeline, control, _state = _init_rank(config, args.rank, store)
    worker = _WorkerState(pipeline)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if not worker.handle(_DECODER.decode(box[0])):
            break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
