"""Admission and lifecycle of public requests over a ``DiffusionKVCacheManager``.

An engine drives it in a loop::

    scheduler.add_request(request)            # request.diffusion_kv_requests moves in here
    output = scheduler.schedule()             # workers: retire output.finished_row_targets,
                                              # then install new/cached metadata, then run
    finished = scheduler.update_from_output(output, completed=done_ids)
    state = scheduler.pop_request_state(id)   # read .status/.error; frees the id for reuse

Admission rules (both policies):

- Every waiting request is in ``waiting``, oldest first; each ``schedule()``
  admits from it while fewer than ``max_num_seqs`` requests run.
- Capacity is backpressure: a request whose reservation returns ``None``
  waits, owning nothing, and is retried on a later pass.
- A request-caused failure (``DiffusionKVAdmissionError``, e.g. a request that
  can never fit the empty pool) finishes *that* request with
  ``FINISHED_ERROR`` and its message, and admission continues with the next
  waiter in the same pass.
- Anything else raised while checking or reserving is an invariant failure:
  the scheduler marks itself dead and raises ``DiffusionKVInvariantError``
  (engine-fatal); it is never reported as one request's error.
- Preemption keeps the reservation and the Worker rows and puts the request
  back at the *head* of the queue, so it resumes ahead of every new request.

The policy (``SchedulingPolicy``, vLLM's ``policy=`` pattern) decides what a
request that does not fit does to the requests behind it:

- ``"fcfs"``: head of the queue only. A head that does not fit stops the pass;
  everything behind it waits too.
- ``"fair"``: a later request that fits *now* (``manager.blocks_required``
  against the free blocks) may overtake an older one that does not, so a small
  request behind a big one that must wait anyway runs at once. Two rules keep
  it fair and correct:

  - no starvation: once the oldest waiting request has been overtaken
    ``max_overtakes`` times, nothing overtakes it any more and the blocks
    freed from then on accumulate for it. The count restarts when the oldest
    is admitted or nothing is waiting; when the oldest leaves otherwise
    (aborted, failed) the next oldest takes the count over;
  - fail fast: every pass first checks each newly waiting request
    (``blocks_required``), so one at fault, one that can never fit the empty
    pool included, fails at once, alone, whether or not a running slot is free.

Worker-row safety: the Worker row pool has ``max_num_seqs *
max_rows_per_request`` rows, and only running and preempted requests hold
rows (and reservations). Preempted requests re-enter at the head, and
admission never passes a preempted request (it holds its reservation, so it
always fits), so running + preempted requests never exceed ``max_num_seqs``
and their rows always fit. ``schedule()`` asserts this
(``DiffusionKVInvariantError``) instead of trusting it: any future queue
reordering that breaks this fails loudly here rather than as a Worker
"only 0 rows are free" error.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from diffusion_kv._validation import is_int, is_positive_int
from diffusion_kv.errors import DiffusionKVAdmissionError, DiffusionKVInvariantError
from diffusion_kv.manager import DiffusionKVCacheManager
from diffusion_kv.metadata import DiffusionKVMetadata
from diffusion_kv.request import DiffusionKVRequest, RequestStatus

logger = logging.getLogger(__name__)

DEFAULT_MAX_OVERTAKES = 16


class SchedulingPolicy(str, enum.Enum):
    """Which waiting requests a ``schedule()`` may admit (see the module docstring)."""

    FCFS = "fcfs"  # the head of the queue only
    FAIR = "fair"  # a request that fits now may overtake one that does not, a bounded number of times


class SchedulableRequest(Protocol):
    """What ``add_request`` reads from an engine request.

    ``diffusion_kv_requests`` is moved into scheduler state and set to
    ``None`` on the request: ``DiffusionKVRequest`` objects are Scheduler-only
    mutable state and must never travel to a Worker.
    """

    request_id: str
    diffusion_kv_requests: Sequence[DiffusionKVRequest] | None


@dataclass
class RequestState:
    """Scheduler-side state of one public request."""

    request_id: str
    request: Any
    kv_requests: tuple[DiffusionKVRequest, ...]
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    allocation_generation: int | None = None
    # Blocks its reservation takes (``manager.blocks_required``); the fair policy checks a request once.
    blocks_required: int | None = None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass(frozen=True)
class NewRequestData:
    """Envelope that carries a request and its KV metadata to Workers, bound together."""

    request_id: str
    req: Any
    diffusion_kv_metadata: DiffusionKVMetadata

    @classmethod
    def from_state(cls, state: RequestState, *, diffusion_kv_metadata: DiffusionKVMetadata) -> NewRequestData:
        envelope = cls(state.request_id, state.request, diffusion_kv_metadata)
        validate_new_request_data_identity(envelope)
        return envelope


def validate_new_request_data_identity(envelope: NewRequestData) -> None:
    """Raise ``ValueError`` unless the envelope, its request and its metadata name one id."""
    req_id = getattr(envelope.req, "request_id", envelope.request_id)
    metadata_id = envelope.diffusion_kv_metadata.request_id
    if not (envelope.request_id == req_id == metadata_id):
        raise ValueError(
            "Diffusion KV request identity mismatch: "
            f"envelope={envelope.request_id!r}, request={req_id!r}, metadata={metadata_id!r}"
        )


@dataclass
class SchedulerOutput:
    """One scheduling decision.

    Workers must retire ``finished_row_targets`` BEFORE installing any new
    metadata of the same output: a release and the admission it enabled can
    arrive together.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # Running requests and resumed (preempted) ones: metadata unchanged, rows already installed.
    scheduled_cached_reqs: list[NewRequestData] = field(default_factory=list)
    # Ids finished since the previous output (released, aborted, failed admission).
    finished_req_ids: set[str] = field(default_factory=set)
    # (request_id, allocation_generation) whose Worker rows must be retired; a
    # generation-matched removal can never touch a reused id's new rows.
    finished_row_targets: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs)


class DiffusionKVScheduler:
    """Admission under a ``SchedulingPolicy`` and request lifecycle with atomic KV reservations.

    ``max_num_seqs`` public requests run at once; the Worker row pool this
    scheduler guarantees never to exceed is ``max_num_seqs *
    manager.max_rows_per_request`` rows (``worker_row_pool_size``).
    ``max_overtakes`` bounds how often the ``"fair"`` policy lets later requests
    overtake the oldest waiting one.
    """

    def __init__(
        self,
        manager: DiffusionKVCacheManager,
        *,
        max_num_seqs: int = 1,
        policy: SchedulingPolicy | str = SchedulingPolicy.FCFS,
        max_overtakes: int = DEFAULT_MAX_OVERTAKES,
    ) -> None:
        if not is_positive_int(max_num_seqs):
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if policy not in tuple(SchedulingPolicy):
            choices = ", ".join(repr(p.value) for p in SchedulingPolicy)
            raise ValueError(f"policy must be one of {choices}, got {policy!r}")
        if not is_int(max_overtakes) or max_overtakes < 0:
            raise ValueError(f"max_overtakes must be an integer >= 0, got {max_overtakes!r}")
        self.manager = manager
        self.policy = SchedulingPolicy(policy)
        self.max_overtakes = max_overtakes
        self.max_num_running_reqs = max_num_seqs
        self.worker_row_pool_size = max_num_seqs * manager.max_rows_per_request
        self._states: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        # Finished since the last schedule(): go out in the next output.
        self._finished_for_workers: dict[str, int | None] = {}
        # Finished and not yet returned by update_from_output.
        self._finished_unreported: set[str] = set()
        # Times later requests overtook the oldest waiting one (fair policy).
        self._oldest_overtaken = 0
        self.fatal_error: BaseException | None = None

    # -- intake --------------------------------------------------------------------

    def add_request(self, request: SchedulableRequest) -> None:
        """Queue a request at the tail; its KV requests move into scheduler state."""
        self._check_alive()
        request_id = request.request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already active.")
        kv_requests = request.diffusion_kv_requests
        if not kv_requests:
            raise ValueError(
                f"request {request_id!r} has no diffusion_kv_requests: give it one DiffusionKVRequest per CFG row"
            )
        kv_requests = tuple(kv_requests)
        if not all(isinstance(kv_request, DiffusionKVRequest) for kv_request in kv_requests):
            raise TypeError("diffusion_kv_requests must contain only DiffusionKVRequest values")
        request.diffusion_kv_requests = None
        self._states[request_id] = RequestState(request_id, request, kv_requests)
        self.waiting.append(request_id)

    # -- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Emit running requests, then admit waiting ones as the policy allows."""
        self._check_alive()
        output = SchedulerOutput()
        for request_id in self.running:
            state = self._states[request_id]
            output.scheduled_cached_reqs.append(
                NewRequestData.from_state(state, diffusion_kv_metadata=self.manager.get_metadata(request_id))
            )
        fair = self.policy is SchedulingPolicy.FAIR
        if fair:
            self._fail_inadmissible()
        for request_id in list(self.waiting):
            if len(self.running) >= self.max_num_running_reqs:
                break
            is_oldest = request_id == self.waiting[0]
            if fair and not is_oldest and self._oldest_overtaken >= self.max_overtakes:
                break  # the oldest has waited long enough: nobody overtakes it
            state = self._states[request_id]
            resumed = state.status == RequestStatus.PREEMPTED
            if resumed:  # it kept its reservation (and its Worker rows)
                metadata = self.manager.get_metadata(request_id)
            elif fair and state.blocks_required > self.manager.get_num_free_blocks():
                continue  # does not fit now: a later request may
            else:
                try:
                    metadata = self.manager.reserve_request(request_id, state.kv_requests)
                except DiffusionKVAdmissionError as exc:
                    self.waiting.remove(request_id)
                    self._finish(state, RequestStatus.FINISHED_ERROR, error=str(exc))
                    continue
                except Exception as exc:
                    self._die(exc, f"reserving KV for request {request_id!r}")
                if metadata is None:  # capacity: it waits, owning nothing
                    if fair:
                        continue
                    break
            self.waiting.remove(request_id)
            state.status = RequestStatus.RUNNING
            state.allocation_generation = metadata.allocation_generation
            self.running.append(request_id)
            envelope = NewRequestData.from_state(state, diffusion_kv_metadata=metadata)
            (output.scheduled_cached_reqs if resumed else output.scheduled_new_reqs).append(envelope)
            self._oldest_overtaken = 0 if is_oldest else self._oldest_overtaken + 1
        if not self.waiting:
            self._oldest_overtaken = 0

        self._assert_installed_rows_fit()
        output.finished_req_ids = set(self._finished_for_workers)
        output.finished_row_targets = [
            (request_id, generation)
            for request_id, generation in self._finished_for_workers.items()
            if generation is not None
        ]
        self._finished_for_workers = {}
        return output

    def _assert_installed_rows_fit(self) -> None:
        installed = [
            request_id
            for request_id, state in self._states.items()
            if state.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
        ]
        rows = sum(self.manager.get_metadata(request_id).num_rows for request_id in installed)
        if rows > self.worker_row_pool_size:
            self._die(
                DiffusionKVInvariantError(
                    f"installed Worker rows ({rows}, running + preempted requests {sorted(installed)}) exceed the "
                    f"row pool of {self.worker_row_pool_size}; admission must never pass a preempted request, "
                    "and preempted requests stay at the head of the queue"
                ),
                "checking the Worker row pool",
            )

    # -- lifecycle ---------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, completed: Iterable[str] = ()) -> set[str]:
        """Finish ``completed`` requests (``FINISHED_STOPPED``) and return every finished, unreported id.

        The result covers admission failures of the ``schedule()`` that built
        ``output``, requests aborted since, and ``completed``.
        """
        self._check_alive()
        scheduled = {envelope.request_id for envelope in output.scheduled_new_reqs}
        scheduled.update(envelope.request_id for envelope in output.scheduled_cached_reqs)
        completed = tuple(completed)
        unscheduled = [request_id for request_id in completed if request_id not in scheduled]
        if unscheduled:
            raise ValueError(f"completed requests {unscheduled} were not scheduled in this output")
        self.finish_requests(completed, RequestStatus.FINISHED_STOPPED)
        finished, self._finished_unreported = self._finished_unreported, set()
        return finished

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (complete, abort, fail) requests and release their KV at once.

        Unknown or already finished ids are ignored. A waiting request that
        was never reserved allocates nothing.
        """
        status = RequestStatus(status)
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            state = self._states.get(request_id)
            if state is None or state.is_finished:
                continue
            if request_id in self.running:
                self.running.remove(request_id)
            else:
                self.waiting.remove(request_id)
                if not self.waiting:
                    self._oldest_overtaken = 0
            self._finish(state, status)

    def preempt_request(self, request_id: str) -> bool:
        """Move a running request to the head of the queue, keeping its reservation and rows.

        Returns False (and changes nothing) for an unknown or not running request.
        """
        state = self._states.get(request_id)
        if state is None or request_id not in self.running:
            return False
        self.running.remove(request_id)
        self.waiting.appendleft(request_id)
        state.status = RequestStatus.PREEMPTED
        for kv_request in state.kv_requests:
            kv_request.num_preemptions += 1
        return True

    def get_request_state(self, request_id: str) -> RequestState:
        try:
            return self._states[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not known to the scheduler") from None

    def pop_request_state(self, request_id: str) -> RequestState:
        """Drop a finished request's state; the id may then be added again."""
        state = self.get_request_state(request_id)
        if not state.is_finished:
            raise ValueError(f"request {request_id!r} is still {state.status.name}; finish it before popping")
        return self._states.pop(request_id)

    def has_requests(self) -> bool:
        """True while anything is waiting or running."""
        return bool(self.waiting or self.running)

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Release every reservation and forget all requests."""
        self.manager.close()
        self.waiting.clear()
        self.running.clear()
        self._states.clear()
        self._finished_for_workers.clear()
        self._finished_unreported.clear()
        self._oldest_overtaken = 0

    # -- internals ---------------------------------------------------------------------

    def _fail_inadmissible(self) -> None:
        """Check every newly waiting request once; finish the ones at fault at once (fair policy)."""
        for request_id in list(self.waiting):
            state = self._states[request_id]
            if state.status == RequestStatus.PREEMPTED or state.blocks_required is not None:
                continue
            try:
                state.blocks_required = self.manager.blocks_required(request_id, state.kv_requests)
            except DiffusionKVAdmissionError as exc:
                self.waiting.remove(request_id)
                self._finish(state, RequestStatus.FINISHED_ERROR, error=str(exc))
            except Exception as exc:
                self._die(exc, f"checking KV for request {request_id!r}")

    def _finish(self, state: RequestState, status: RequestStatus, *, error: str | None = None) -> None:
        state.status = status
        state.error = error
        self.manager.free_request(state.request_id)
        self._finished_for_workers[state.request_id] = state.allocation_generation
        self._finished_unreported.add(state.request_id)

    def _check_alive(self) -> None:
        if self.fatal_error is not None:
            raise DiffusionKVInvariantError(
                "the Diffusion KV scheduler stopped after an invariant failure; close it and restart the engine"
            ) from self.fatal_error

    def _die(self, exc: BaseException, doing: str) -> NoReturn:
        self.fatal_error = exc
        logger.error("Diffusion KV invariant failure while %s: %r", doing, exc)
        if isinstance(exc, DiffusionKVInvariantError):
            raise exc
        raise DiffusionKVInvariantError(f"Diffusion KV invariant failure while {doing}: {exc!r}") from exc


__all__ = [
    "DEFAULT_MAX_OVERTAKES",
    "DiffusionKVScheduler",
    "NewRequestData",
    "RequestState",
    "SchedulableRequest",
    "SchedulerOutput",
    "SchedulingPolicy",
    "validate_new_request_data_identity",
]
