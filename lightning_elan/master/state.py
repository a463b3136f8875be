"""The job state machine of the application master (pure: no sockets, no files, no torch).

Each transition is a method of ``JobState`` that validates its input first and raises ``StateError`` with a message
for the client; the server persists the whole state (``to_dict``) after every transition. Semantics:
docs/architecture.md, *Semantics of the AM*.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elan.master.enrolment import Enrollee, Enrolment
from lightning_elan.master.measure import Measurements
from lightning_elan.master.narration import plural, workers_phrase
from lightning_elan.master.recovery import CheckIn, Recovery, recovery_plan
from lightning_elan.master.sizing_state import SizingState
from lightning_elan.master.standby import STANDBY_REQUEST, StandbyPool
from lightning_elan.protocol.contract import (
    DEFAULT_COORDINATE_EVERY,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_RECOVERY_TIMEOUT_S,
    DEFAULT_REPORT_TIMEOUT_S,
    FINISHED_BY_AM,
    LEAVE_CANCELLED,
    LEAVE_FINISHED,
    LEAVE_QUEUED,
    MAX_WORLD_SIZE,
    REPORT_ROLES,
    ROLE_WAITING,
    AdjustmentPlan,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    EnrolReply,
    EnrolRequest,
    RecoverRequest,
    RegisterRequest,
    Transfer,
    WaitPlanReply,
    WorkerStats,
    worker_number,
)
from lightning_elan.replication.sources import plan_replication
from lightning_elan.replication.topology import WorkerTopology

logger = logging.getLogger(__name__)

ACTIONS = ("add", "remove", "migrate", "to")
LEAVE = "leave"  # the action of the requests ``request_leave`` queues (not a ``scale`` action)
MAX_COMPLETING = 8  # committed adjustments still waiting for reports; older ones are dropped
MAX_FAILURES = 50  # failed or cancelled requests and adjustments kept for status (oldest dropped)

# where a member's last step (status) comes from
STEP_FROM_COORDINATE = "coordinate"  # the step of its last coordinate (rank 0)
STEP_FROM_REPORT = "report"  # the step of its last adjustment report (the report's step, else the plan's)

# PendingWorker.status values
REQUESTED = "requested"  # created by a scale request, not yet handed to the launcher
SPAWNED = "spawned"  # returned by launcher_poll
READY = "ready"  # registered (reported ready); waits for its plan
CANCELLED = "cancelled"  # its request failed (a partner exited) or was cancelled (shutdown)
WAITING_STATUSES = (REQUESTED, SPAWNED, READY)


class StateError(Exception):
    """A request the job state refuses; ``str(error)`` is the message for the client."""


@dataclass
class Member:
    """A worker of the current generation."""

    worker_id: str
    joined_generation: int = 0
    host: str | None = None
    device: str | int | None = None
    pid: int | None = None
    topology: dict[str, Any] | None = None  # WorkerTopology.to_dict() sent with register, if any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Member:
        return cls(**data)


@dataclass
class PendingWorker:
    """A joiner created by a scale request that is not a member yet."""

    worker_id: str
    request_id: str
    status: str = REQUESTED
    host: str | None = None
    device: str | int | None = None
    pid: int | None = None
    topology: dict[str, Any] | None = None
    spawned_at: float | None = None
    ready_at: float | None = None
    reason: str | None = None  # why it was cancelled or failed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingWorker:
        return cls(**data)


@dataclass
class ScaleRequest:
    """A queued scale request, resolved at request time into workers to add and a removal rule."""

    request_id: str
    action: str
    count: int | None = None
    ranks: list[int] | None = None  # remove these ranks (of the generation the request applies to)
    size: int | None = None
    at_step: int | None = None
    add_count: int = 0
    remove_count: int = 0  # remove this many of the newest old members
    new_workers: list[str] = field(default_factory=list)
    requested_at: float = 0.0
    all_reported_at: float | None = None  # when the last new worker registered
    workers: list[str] | None = None  # remove exactly these workers (a ``leave`` request)
    cause: dict[str, Any] | None = None  # the AM's own decision behind it (autoscaler, profile, straggler), if any

    @property
    def size_change(self) -> int:
        return self.add_count - self.remove_count - len(self.ranks or []) - len(self.workers or [])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleRequest:
        return cls(**data)


@dataclass
class Adjustment:
    """A decided plan with its timeline and the reports received so far."""

    plan: AdjustmentPlan
    requested_at: float
    all_reported_at: float | None
    decided_at: float
    committed_at: float | None = None
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # a recovery plan's: who died, when it was detected, the step redone
    cause: dict[str, Any] | None = None  # the AM's own decision that requested it (``ScaleRequest.cause``)

    def all_members_reported(self) -> bool:
        return self.committed_at is not None and all(worker in self.reports for worker in self.plan.members)

    def record(self, job: str, completed_at: float) -> dict[str, Any]:
        """The adjustment record written to ``adjustments.jsonl``."""
        plan = self.plan
        return {
            "job": job,
            "request_id": plan.request_id,
            "action": plan.action,
            "requested_at": self.requested_at,
            "all_reported_at": self.all_reported_at,
            "decided_at": self.decided_at,
            "completed_at": completed_at,
            "step": plan.step,
            "generation": plan.generation,
            "members": list(plan.members),
            "joiners": list(plan.joiners),
            "leavers": list(plan.leavers),
            "sources": dict(plan.sources),
            "transfers": None if plan.transfers is None else [transfer.to_dict() for transfer in plan.transfers],
            "bytes_replicated": sum(report.get("bytes_received") or 0 for report in self.reports.values()),
            "pause_s": {worker: self.reports[worker].get("pause_s") for worker in plan.stayers},
            "joiner_startup_s": {worker: self.reports[worker].get("startup_s") for worker in plan.joiners},
            "received": {
                worker: {"source": self.reports[worker].get("received_from"),
                         "route": self.reports[worker].get("received_over"),
                         "in_place_bytes": self.reports[worker].get("bytes_in_place"),
                         "prefaulted": self.reports[worker].get("prefaulted")}
                for worker in plan.joiners
            },
            **self._scaling_outcome(),
            **({"failure": self.failure} if self.failure else {}),
            **({"cause": self.cause} if self.cause else {}),
        }

    def _scaling_outcome(self) -> dict[str, Any]:
        """The global batch and scaling decision the new members report they applied (they must all agree)."""
        applied = {
            worker: (self.reports[worker].get("global_batch"), self.reports[worker].get("scaling"))
            for worker in self.plan.members
        }
        distinct = {json.dumps(value, sort_keys=True) for value in applied.values()}
        if len(distinct) > 1:
            logger.error("adjustment to generation %d: members applied different scaling: %s", self.plan.generation,
                         applied)
            return {"global_batch": None, "scaling": None,
                    "scaling_mismatch": {worker: value[0] for worker, value in applied.items()}}
        global_batch, decision = next(iter(applied.values()), (None, None))
        return {"global_batch": global_batch, "scaling": decision}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["plan"] = self.plan.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Adjustment:
        return cls(**{**data, "plan": AdjustmentPlan.from_dict(data["plan"])})


@dataclass
class Progress:
    """Training progress as last reported by rank 0's ``coordinate``, and each worker's last known step.

    Informational (status only): persisted with the state but never a reason to write it.
    """

    step: int | None = None
    epoch: int | None = None
    position: int | None = None
    global_batch: int | None = None
    updated_at: float | None = None
    scaling: dict[str, Any] | None = None  # rank 0's last scaling summary (HybridScaling), for status
    generation: int | None = None  # the generation of the coordinate that set ``step``
    remaining_samples: int | None = None  # samples left to train, when rank 0's loop knows its length
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker → {step, source, at}

    def is_stale(self, generation: int, step: int) -> bool:
        """A coordinate of ``generation`` at ``step`` is older than the one already recorded (a reordered frame)."""
        return self.generation == generation and self.step is not None and step < self.step

    def note_step(self, worker_id: str, step: int, source: str, at: float) -> None:
        """Record ``worker_id``'s last known step (never moves it back within what was recorded)."""
        last = self.workers.get(worker_id)
        if last is None or source == STEP_FROM_COORDINATE or step >= last["step"]:
            self.workers[worker_id] = {"step": step, "source": source, "at": at}

    def forget(self, keep: list[str]) -> None:
        """Drop the steps of workers that are no longer members."""
        self.workers = {worker: last for worker, last in self.workers.items() if worker in keep}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(**data)


@dataclass
class JobState:
    """Membership, queued requests and the adjustment in flight of one job."""

    job: str
    started: bool = False
    coordinate_every: int | None = None
    generation: int = 0
    members: list[Member] = field(default_factory=list)  # rank order
    pending: list[ScaleRequest] = field(default_factory=list)  # FIFO
    pending_workers: dict[str, PendingWorker] = field(default_factory=dict)
    left_workers: list[str] = field(default_factory=list)
    in_flight: Adjustment | None = None
    completing: list[Adjustment] = field(default_factory=list)
    last_plan: AdjustmentPlan | None = None
    last_adjustment: dict[str, Any] | None = None
    progress: Progress = field(default_factory=Progress)
    finished: bool = False
    finish_reason: str | None = None
    next_worker: int = 0
    next_request: int = 1
    report_timeout_s: float = DEFAULT_REPORT_TIMEOUT_S
    failures: list[dict[str, Any]] = field(default_factory=list)  # the last MAX_FAILURES, oldest first
    am_restarts: int = 0  # how many times an AM process resumed this state from its store
    recovery: Recovery | None = None  # a member died: the survivors are checking in
    replace_failed: bool = False  # queue one joiner for each member that dies
    min_workers: int = 1  # below this many survivors the recovery waits for joiners
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S  # how long it waits for them before the job fails
    failed_reason: str | None = None  # why the job stopped unfinished (no survivor, too few workers)
    next_failure: int = 1
    trained_out: list[str] = field(default_factory=list)  # members that exited 0 (fit returned), this generation
    enrolment: Enrolment | None = None  # workers come from a scheduler (`elan worker`), not from `elan run`
    standby: StandbyPool = field(default_factory=StandbyPool)  # warmed-up joiners no request has taken yet
    sizing: SizingState = field(default_factory=SizingState)  # profile, autoscaler, stragglers (master/sizing.py)
    measured: Measurements = field(default_factory=Measurements)  # throughput and compute (informational)

    # ---- serialisation -------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "started": self.started,
            "coordinate_every": self.coordinate_every,
            "generation": self.generation,
            "members": [member.to_dict() for member in self.members],
            "pending": [request.to_dict() for request in self.pending],
            "pending_workers": {worker: pending.to_dict() for worker, pending in self.pending_workers.items()},
            "left_workers": list(self.left_workers),
            "in_flight": self.in_flight.to_dict() if self.in_flight else None,
            "completing": [adjustment.to_dict() for adjustment in self.completing],
            "last_plan": self.last_plan.to_dict() if self.last_plan else None,
            "last_adjustment": self.last_adjustment,
            "progress": self.progress.to_dict(),
            "finished": self.finished,
            "finish_reason": self.finish_reason,
            "next_worker": self.next_worker,
            "next_request": self.next_request,
            "report_timeout_s": self.report_timeout_s,
            "failures": [dict(failure) for failure in self.failures],
            "am_restarts": self.am_restarts,
            "recovery": self.recovery.to_dict() if self.recovery else None,
            "replace_failed": self.replace_failed,
            "min_workers": self.min_workers,
            "join_timeout_s": self.join_timeout_s,
            "failed_reason": self.failed_reason,
            "next_failure": self.next_failure,
            "trained_out": list(self.trained_out),
            "enrolment": self.enrolment.to_dict() if self.enrolment else None,
            "standby": self.standby.to_dict(),
            "sizing": self.sizing.to_dict(),
            "measured": self.measured.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobState:
        return cls(
            job=data["job"],
            started=data["started"],
            coordinate_every=data["coordinate_every"],
            generation=data["generation"],
            members=[Member.from_dict(member) for member in data["members"]],
            pending=[ScaleRequest.from_dict(request) for request in data["pending"]],
            pending_workers={worker: PendingWorker.from_dict(p) for worker, p in data["pending_workers"].items()},
            left_workers=list(data["left_workers"]),
            in_flight=Adjustment.from_dict(data["in_flight"]) if data["in_flight"] else None,
            completing=[Adjustment.from_dict(adjustment) for adjustment in data["completing"]],
            last_plan=AdjustmentPlan.from_dict(data["last_plan"]) if data["last_plan"] else None,
            last_adjustment=data["last_adjustment"],
            progress=Progress.from_dict(data["progress"]),
            finished=data["finished"],
            finish_reason=data["finish_reason"],
            next_worker=data["next_worker"],
            next_request=data["next_request"],
            report_timeout_s=data.get("report_timeout_s", DEFAULT_REPORT_TIMEOUT_S),
            failures=list(data.get("failures", [])),
            am_restarts=data.get("am_restarts", 0),
            recovery=Recovery.from_dict(data["recovery"]) if data.get("recovery") else None,
            replace_failed=data.get("replace_failed", False),
            min_workers=data.get("min_workers", 1),
            join_timeout_s=data.get("join_timeout_s", DEFAULT_JOIN_TIMEOUT_S),
            failed_reason=data.get("failed_reason"),
            next_failure=data.get("next_failure", 1),
            trained_out=list(data.get("trained_out", [])),
            enrolment=Enrolment.from_dict(data["enrolment"]) if data.get("enrolment") else None,
            standby=StandbyPool.from_dict(data.get("standby")),
            sizing=SizingState.from_dict(data.get("sizing")),
            measured=Measurements.from_dict(data.get("measured")),
        )

    # ---- queries -------------------------------------------------------------------------------------------------

    @property
    def member_ids(self) -> list[str]:
        return [member.worker_id for member in self.members]

    @property
    def world_size(self) -> int:
        return len(self.members)

    def projected_size(self) -> int:
        """World size once every pending request has applied."""
        return self.world_size + sum(request.size_change for request in self.pending)

    def member(self, worker_id: str) -> Member | None:
        return next((member for member in self.members if member.worker_id == worker_id), None)

    def is_known(self, worker_id: str) -> bool:
        return self.member(worker_id) is not None or worker_id in self.pending_workers or worker_id in self.left_workers

    def status(self) -> dict[str, Any]:
        """The reply body of ``status``."""
        return {
            "job": self.job,
            "generation": self.generation,
            "members": [self._member_summary(rank, member) for rank, member in enumerate(self.members)],
            "step": self.progress.step,
            "epoch": self.progress.epoch,
            "position": self.progress.position,
            "global_batch": self.progress.global_batch,
            "scaling": self.progress.scaling,
            "pending": [self._pending_summary(request) for request in self.pending],
            "in_flight": self.in_flight.plan.to_dict() if self.in_flight else None,
            "last_adjustment": self.last_adjustment,
            "failures": [dict(failure) for failure in self.failures],
            "am": {"restarts": self.am_restarts},
            "recovery": self._recovery_summary(),
            "enrolment": self._enrolment_summary(),
            "standby": self._standby_summary(),
            "sizing": {**self.sizing.summary(), "measured": self.measured.summary()},
            "finished": self.finished,
            "failed_reason": self.failed_reason,
        }

    def _standby_summary(self) -> dict[str, Any] | None:
        """The standby pool (``elan run --standby K``): its target and its workers with their status; None without."""
        if not self.standby.target and not self.standby.workers:
            return None
        workers = [{"worker_id": worker, "status": self.pending_workers[worker].status,
                    "host": self.pending_workers[worker].host} for worker in self.standby.workers]
        return {"target": self.standby.target, "workers": workers}

    def _enrolment_summary(self) -> dict[str, Any] | None:
        """A job of `elan worker`s: its bounds and, before the start, the workers waiting for it (None otherwise)."""
        if self.enrolment is None:
            return None
        return {"min_workers": self.enrolment.min_workers, "max_workers": self.enrolment.max_workers,
                "started": self.started,
                "waiting": [{"worker_id": e.worker_id, "host": e.host, "pid": e.pid} for e in self.enrolment.waiting]}

    def _recovery_summary(self) -> dict[str, Any] | None:
        recovery = self.recovery
        if recovery is None:
            return None
        return {"failure_id": recovery.failure_id, "dead": list(recovery.dead),
                "failed_generations": list(recovery.failed_generations), "survivors": list(recovery.survivors),
                "checked_in": sorted(recovery.checked_in), "detected_at": recovery.detected_at}

    def _member_summary(self, rank: int, member: Member) -> dict[str, Any]:
        """One member in ``status``: where it runs and its last known step (``last_step_from`` says how it is known:
        ``coordinate`` = its last coordinate, ``report`` = its last adjustment report; None = not heard of yet)."""
        last = self.progress.workers.get(member.worker_id) or {}
        return {
            "worker_id": member.worker_id,
            "rank": rank,
            "host": member.host,
            "device": member.device,
            "pid": member.pid,
            "joined_generation": member.joined_generation,
            "last_step": last.get("step"),
            "last_step_from": last.get("source"),
            "last_seen_at": last.get("at"),
        }

    def _pending_summary(self, request: ScaleRequest) -> dict[str, Any]:
        workers = {worker: self.pending_workers[worker].status for worker in request.new_workers}
        return {**request.to_dict(), "worker_status": workers}

    # ---- transitions ---------------------------------------------------------------------------------------------

    def start_job(
        self, nproc: int, coordinate_every: int | None = None, hosts: Any = None, report_timeout_s: float | None = None,
        replace_failed: bool = False, min_workers: int | None = None, join_timeout_s: float | None = None,
        standby: int = 0,
    ) -> dict[str, Any]:
        """Create generation 0 with members w0..w{nproc-1} (and ``standby`` standby workers, started by the next
        ``launcher_poll``); a started job just returns its current membership."""
        if self.started:
            return self._membership()
        if nproc < 1:
            raise StateError(f"nproc must be ≥ 1, got {nproc}")
        if nproc > MAX_WORLD_SIZE:
            raise StateError(f"nproc must be ≤ {MAX_WORLD_SIZE}, got {nproc}")
        if coordinate_every is not None and coordinate_every < 1:
            raise StateError(f"coordinate_every must be ≥ 1, got {coordinate_every}")
        worker_ids = [f"w{self.next_worker + index}" for index in range(nproc)]
        host_of = _initial_hosts(worker_ids, hosts)
        self.members = [Member(worker, 0, host=host_of.get(worker)) for worker in worker_ids]
        self.next_worker += nproc
        self.coordinate_every = coordinate_every
        if report_timeout_s is not None:
            if report_timeout_s <= 0:
                raise StateError(f"report_timeout_s must be > 0, got {report_timeout_s}")
            self.report_timeout_s = float(report_timeout_s)
        self._set_failure_policy(replace_failed, min_workers, join_timeout_s)
        try:
            self.standby = StandbyPool(target=int(standby))
        except ValueError as error:
            raise StateError(str(error)) from None
        self.started = True
        self._refill_standby()
        return self._membership()

    def scale(
        self,
        action: str,
        count: int | None = None,
        ranks: list[int] | None = None,
        size: int | None = None,
        at_step: int | None = None,
        now: float | None = None,
        cause: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Queue a scale request and create its new workers; returns ``{request_id, new_workers}``. ``cause``: the AM's
        own decision behind it (recorded with the adjustment)."""
        self._require_running()
        if self.in_flight is not None:
            raise StateError(
                f"adjustment in flight (generation {self.generation} → {self.in_flight.plan.generation}); retry"
            )
        if self.recovery is not None:
            raise StateError(f"recovering from the death of {', '.join(self.recovery.dead)}; retry")
        request = self._resolve_request(action, count, ranks, size, at_step)
        request.cause = cause
        if request.add_count and self.enrolment is not None:
            raise StateError(f"the workers of job {self.job} are started by their scheduler: to add one, start another "
                             f"`elan worker --job {self.job}` (it joins by itself); `{action}` cannot start it")
        return self._queue(request, now)

    # ---- workers started by a scheduler (`elan worker`) ----------------------------------------------------------

    def accept_enrolments(self, enrolment: Enrolment, coordinate_every: int | None = None,
                          report_timeout_s: float | None = None, join_timeout_s: float | None = None) -> None:
        """Let workers enrol (``elan am --min-workers``); the job starts from the first ``enrolment.max_workers``."""
        if self.started or self.enrolment is not None:
            return  # a resumed AM keeps what its state says
        self.enrolment = enrolment
        self.coordinate_every = coordinate_every
        if report_timeout_s is not None:
            self.report_timeout_s = float(report_timeout_s)
        self._set_failure_policy(False, enrolment.min_workers, join_timeout_s)

    def enrol(self, request: EnrolRequest, now: float | None = None) -> EnrolReply:
        """A new worker gets an id (a place in generation 0, or a joiner's add request); a known one polls."""
        if self.enrolment is None:
            raise StateError(f"job {self.job} does not take `elan worker`s: its workers are started by `elan run` "
                             "(start its AM with `elan am --min-workers N` for workers started by a scheduler)")
        if self.finished:
            raise StateError(f"job {self.job} has finished ({self.finish_reason})")
        if request.worker_id is not None:
            return self._enrolment_of(request.worker_id, _now(now))
        if self.started:
            return self._enrol_joiner(request, _now(now))
        if self.enrolment.is_full():
            raise StateError(f"job {self.job} has its {plural(self.enrolment.max_workers, 'worker')} (--max-workers)")
        worker_id = self._new_worker_ids(1)[0]
        self.enrolment.enrol(worker_id, request.host, request.pid, _now(now))
        logger.info("job %s: %s enrolled from %s (%d waiting, the job starts at %d)", self.job, worker_id,
                    request.host, len(self.enrolment.waiting), self.enrolment.min_workers)
        self.housekeeping(_now(now))
        return self._enrolment_of(worker_id, _now(now))

    def _enrol_joiner(self, request: EnrolRequest, now: float) -> EnrolReply:
        assert self.enrolment is not None
        if self.projected_size() >= self.enrolment.max_workers:
            raise StateError(f"job {self.job} has its {plural(self.enrolment.max_workers, 'worker')} (--max-workers): "
                             "this worker is not needed")
        if self._training_over():
            raise StateError(f"job {self.job} has finished training (a member of generation {self.generation} "
                             "completed it): this worker is not needed")
        queued = ScaleRequest(request_id="", action="add", count=1, size=None, at_step=None)
        queued.add_count = 1
        worker_id = self._queue(queued, now)["new_workers"][0]
        pending = self.pending_workers[worker_id]
        pending.status, pending.spawned_at, pending.host, pending.pid = SPAWNED, now, request.host, request.pid
        logger.info("job %s: %s enrolled from %s as a joiner (request %s)", self.job, worker_id, request.host,
                    queued.request_id)
        return self._enrolment_of(worker_id, now)

    def _enrolment_of(self, worker_id: str, now: float) -> EnrolReply:
        member = self.member(worker_id)
        if member is not None:
            return EnrolReply(worker_id, "member", self.generation, self.member_ids.index(worker_id), self.world_size,
                              self.coordinate_every or DEFAULT_COORDINATE_EVERY)
        if worker_id in self.pending_workers:
            return EnrolReply(worker_id, "joiner", coordinate_every=self.coordinate_every or DEFAULT_COORDINATE_EVERY)
        if self.enrolment is not None and self.enrolment.seen(worker_id, now):
            return EnrolReply(worker_id, ROLE_WAITING)
        if worker_id in self.left_workers:
            raise StateError(f"worker {worker_id} has left job {self.job}")
        raise StateError(f"worker {worker_id} is not enrolled in job {self.job} (dropped after "
                         f"{self.enrolment.silence_s if self.enrolment else 0:.0f} s without a poll?): enrol again")

    def housekeeping(self, now: float | None = None) -> list[str]:
        """The AM's own clock for a job of enrolled workers (``elan run``'s launcher drives it otherwise): start the
        job, fail joiners that never report, declare silent survivors dead, finish once every member trained out.
        Returns the workers declared dead."""
        now = _now(now)
        if self.enrolment is None or self.finished:
            return []
        if not self.started:
            self._start_if_enrolled(now)
            return []
        dead = self._fail_unreported(now) + self._declare_silent_survivors_dead(now)
        self._form_recovery_plan_if_ready(now)
        if self.in_flight is None and self.members and all(w in self.trained_out for w in self.member_ids):
            self.shutdown(FINISHED_BY_AM)
        return dead

    def _start_if_enrolled(self, now: float) -> None:
        assert self.enrolment is not None
        for worker in self.enrolment.drop_silent(now):
            logger.warning("job %s: %s stopped polling before the start: dropped", self.job, worker)
        enrollees = self.enrolment.starting_members(now)
        if enrollees is None:
            return
        self.members = [_member_of(enrollee) for enrollee in enrollees]
        self.enrolment.waiting = []
        self.started = True
        logger.info("job %s starts with %s: %s", self.job, plural(len(self.members), "enrolled worker"),
                    workers_phrase(self.member_ids))

    def _new_worker_ids(self, count: int) -> list[str]:
        ids = [f"w{self.next_worker + index}" for index in range(count)]
        self.next_worker += count
        return ids

    def _queue(self, request: ScaleRequest, now: float | None) -> dict[str, Any]:
        request.request_id = f"r{self.next_request}"
        self.next_request += 1
        request.requested_at = _now(now)
        taken = self._take_standbys(request.add_count, request.request_id)
        fresh = [f"w{self.next_worker + index}" for index in range(request.add_count - len(taken))]
        self.next_worker += len(fresh)
        for worker in fresh:
            self.pending_workers[worker] = PendingWorker(worker, request.request_id)
        request.new_workers = taken + fresh
        if all(self.pending_workers[worker].status == READY for worker in request.new_workers):
            request.all_reported_at = request.requested_at  # nothing to start: standbys, or no new worker at all
        self.pending.append(request)
        self._refill_standby()
        return {"request_id": request.request_id, "new_workers": list(request.new_workers)}

    def _take_standbys(self, count: int, request_id: str) -> list[str]:
        """Up to ``count`` standbys for a request, ready ones first; they become the request's new workers."""
        readiness = {READY: 2, SPAWNED: 1, REQUESTED: 0}
        taken = self.standby.take(count, lambda worker: readiness.get(self.pending_workers[worker].status, -1))
        for worker in taken:
            self.pending_workers[worker].request_id = request_id
        if taken:
            logger.info("job %s: request %s takes standby %s", self.job, request_id, _named(taken))
        return taken

    def _refill_standby(self) -> None:
        """Start workers until the standby pool is back at its target (the launcher spawns them at its next poll)."""
        if self.finished:
            return
        for _ in range(self.standby.missing()):
            worker = f"w{self.next_worker}"
            self.next_worker += 1
            self.pending_workers[worker] = PendingWorker(worker, STANDBY_REQUEST)
            self.standby.workers.append(worker)

    def idle_answer(self, worker_id: str) -> WaitPlanReply:
        """What a long poll with nothing decided answers: ``standby`` to a worker of the pool, else ``wait``."""
        pending = self.pending_workers.get(worker_id)
        if pending is not None and pending.request_id == STANDBY_REQUEST and pending.status != CANCELLED:
            return WaitPlanReply.standby()
        return WaitPlanReply.wait()

    def launcher_poll(self, now: float | None = None) -> dict[str, Any]:
        """Hand the launcher the workers it has to start (marked spawned) and those it has to stop (their request
        failed because a worker of it never reported ready)."""
        spawn = []
        for pending in self.pending_workers.values():
            if pending.status == REQUESTED:
                pending.status = SPAWNED
                pending.spawned_at = _now(now)
                spawn.append({"worker_id": pending.worker_id, "request_id": pending.request_id})
        stop = self._fail_unreported(_now(now)) + self._declare_silent_survivors_dead(_now(now))
        self._form_recovery_plan_if_ready(_now(now))  # a joiner it waited for may be ready, or its wait over
        return {"spawn": spawn, "stop": stop, "finished": self.finished}

    def _fail_unreported(self, now: float) -> list[str]:
        """Fail every request with a worker started more than ``report_timeout_s`` ago that never reported."""
        stop = self._drop_unreported_standbys(now)
        for request in list(self.pending):
            late = [
                worker for worker in request.new_workers
                if (pending := self.pending_workers.get(worker)) is not None and pending.status == SPAWNED
                and pending.spawned_at is not None and now - pending.spawned_at > self.report_timeout_s
            ]
            if late:
                reason = f"{_named(late)} did not report ready within {self.report_timeout_s:.0f} s"
                self._fail_request(request, reason)
                stop += [worker for worker in request.new_workers if worker in self.pending_workers]
        return stop

    def _drop_unreported_standbys(self, now: float) -> list[str]:
        """Standbys started more than ``report_timeout_s`` ago that never reported: stopped (not replaced until the
        next ``add``: a start-up that fails may fail again)."""
        late = [worker for worker in self.standby.workers if self.pending_workers[worker].status == SPAWNED
                and now - (self.pending_workers[worker].spawned_at or now) > self.report_timeout_s]
        for worker in late:
            self.standby.discard(worker)
            self._cancel_standby(worker, f"did not report ready within {self.report_timeout_s:.0f} s")
        return late

    def _cancel_standby(self, worker_id: str, reason: str) -> None:
        pending = self.pending_workers[worker_id]
        pending.status, pending.reason = CANCELLED, f"standby {worker_id} {reason}"
        logger.warning("job %s: standby %s %s", self.job, worker_id, reason)
        self.record_failure({"kind": "standby", "outcome": "cancelled", "worker_id": worker_id, "reason": reason})

    def register(self, request: RegisterRequest, now: float | None = None) -> dict[str, Any]:
        """Record a worker's host/device/pid (and topology); for a joiner this is *report ready*."""
        worker_id = request.worker_id
        where = (request.host, request.device, request.pid, _checked_topology(worker_id, request.topology))
        member = self.member(worker_id)
        if member is not None:
            member.host, member.device, member.pid, member.topology = where
            return {}
        pending = self.pending_workers.get(worker_id)
        if pending is None:
            if worker_id in self.left_workers:
                raise StateError(f"worker {worker_id} has left the job")
            raise StateError(f"unknown worker {worker_id}")
        pending.host, pending.device, pending.pid, pending.topology = where
        if pending.status in (REQUESTED, SPAWNED):
            pending.status = READY
            pending.ready_at = _now(now)
            self._note_ready(pending.request_id, pending.ready_at)
        return {}

    def coordinate(self, request: CoordinateRequest, now: float | None = None) -> CoordinateReply:
        """Rank 0's periodic question: no decision, or the plan to adjust to; ``request.scaling`` is rank 0's latest
        scaling summary when it sends one (kept until the next)."""
        worker_id, generation = request.worker_id, request.generation
        self._require_started()
        _require_non_negative(generation=generation, step=request.step)
        self._require_known(worker_id)
        self._commit_if_new_generation(worker_id, generation, now)
        if generation != self.generation:
            raise StateError(f"generation {generation} is not current (current generation {self.generation})")
        if self.member(worker_id) is None:
            raise StateError(f"worker {worker_id} is not a member of generation {self.generation}")
        if self.progress.is_stale(generation, request.step):
            logger.debug("stale coordinate from %s at step %s (already at %s): ignored", worker_id, request.step,
                         self.progress.step)
            return CoordinateReply.adjust(self.in_flight.plan) if self.in_flight else CoordinateReply.none()
        self._note_progress(request, _now(now))
        if self.in_flight is not None:
            return CoordinateReply.adjust(self.in_flight.plan)
        if self.recovery is not None:  # the members are about to learn that the generation failed
            return CoordinateReply.none()
        plan = None if self.finished else self._decide_head(request.step, now)
        return CoordinateReply.none() if plan is None else CoordinateReply.adjust(plan)

    def _note_progress(self, request: CoordinateRequest, now: float) -> None:
        """Record rank 0's progress (and scaling summary, kept until the next) and the coordinating worker's step."""
        progress = self.progress
        progress.step, progress.epoch, progress.position = request.step, request.epoch, request.position
        progress.global_batch, progress.updated_at, progress.generation = request.global_batch, now, request.generation
        progress.scaling = request.scaling or progress.scaling
        progress.remaining_samples = request.remaining_samples
        progress.note_step(request.worker_id, request.step, STEP_FROM_COORDINATE, now)
        self.measured.observe_coordinate(request.generation, self.world_size, request.step, request.global_batch, now)

    def worker_stats(self, stats: WorkerStats) -> dict[str, Any]:
        """A member's compute time per step (informational: feeds the straggler detector); answers the stragglers."""
        if stats.generation != self.generation or self.member(stats.worker_id) is None:
            return {"stragglers": [], "ignored": True}
        return {"stragglers": self.measured.observe_compute(stats.worker_id, stats.generation, stats.compute_s,
                                                            self.member_ids)}

    def report(self, report: AdjustmentReport, now: float | None = None) -> dict[str, Any] | None:
        """Record a worker's report after an adjustment; returns the adjustment record once all members reported.
        ``global_batch`` and ``scaling`` are the global batch and the scaling decision the worker applied."""
        worker_id, generation = report.worker_id, report.generation
        _require_non_negative(generation=generation, step=report.step)
        self._require_known(worker_id)
        if report.role not in REPORT_ROLES:
            raise StateError(f"unknown role {report.role!r} (expected stayer, joiner or leaver)")
        self._commit_if_new_generation(worker_id, generation, now)
        adjustment = self._adjustment_to(generation)
        if adjustment is None:
            if generation <= self.generation:  # a late duplicate: the adjustment is already recorded
                return None
            raise StateError(f"no adjustment to generation {generation} (current generation {self.generation})")
        if not adjustment.plan.involves(worker_id):
            raise StateError(f"worker {worker_id} is not part of the adjustment to generation {generation}")
        if worker_id in adjustment.reports:  # a duplicate (resent under a new id): the first report stands
            logger.debug("duplicate report of %s for generation %s: ignored", worker_id, generation)
            return None
        adjustment.reports[worker_id] = _stored_report(report, _now(now))
        if worker_id in adjustment.plan.members and self.member(worker_id) is not None:
            step = adjustment.plan.step if report.step is None else report.step
            self.progress.note_step(worker_id, step, STEP_FROM_REPORT, _now(now))
        return self._complete_if_all_reported(adjustment, now)

    def wait_plan(self, worker_id: str) -> WaitPlanReply | None:
        """The answer to a joiner's ``wait_plan``: a plan, a cancellation, or None to keep waiting."""
        self._require_known(worker_id)
        recovery = self.recovery
        if recovery is not None and worker_id in recovery.dead:
            return WaitPlanReply.cancelled(f"worker {worker_id} was declared dead ({recovery.failure_id})")
        if recovery is not None and worker_id in recovery.survivors:
            return None  # the recovery plan is not formed yet
        if self.in_flight is not None and self.in_flight.plan.involves(worker_id):
            return WaitPlanReply.with_plan(self.in_flight.plan)
        last = self.last_plan
        if last is not None and last.generation == self.generation and worker_id in last.joiners:
            return WaitPlanReply.with_plan(last)  # asked again after its plan was committed
        pending = self.pending_workers.get(worker_id)
        if pending is not None and pending.status == CANCELLED:
            return WaitPlanReply.cancelled(pending.reason or f"worker {worker_id} was cancelled")
        if worker_id in self.left_workers:
            return WaitPlanReply.cancelled(f"worker {worker_id} has left the job")
        if self.finished:
            return WaitPlanReply.cancelled(f"job finished: {self.finish_reason}")
        return None

    # ---- worker failures (lightning_elan.master.recovery) ---------------------------------------------------------

    def recover(self, request: RecoverRequest, now: float | None = None) -> dict[str, Any]:
        """A survivor of a failed generation checks in; the reply is ``wait_plan``'s (it then long-polls that)."""
        worker_id = request.worker_id
        self._require_known(worker_id)
        _require_non_negative(generation=request.generation, step=request.step)
        recovery = self.recovery
        if recovery is None:
            answer = self.wait_plan(worker_id)
            if answer is not None and (answer.plan is None or answer.plan.generation > request.generation):
                return answer.to_body()  # asked again after the recovery plan was formed, or cancelled
            raise StateError(f"generation {request.generation} has not failed (current generation {self.generation})")
        if request.generation not in recovery.failed_generations:
            raise StateError(f"generation {request.generation} is not one of the failed generations "
                             f"{recovery.failed_generations}")
        if worker_id in recovery.survivors:
            step = request.step if request.has_state else None
            recovery.checked_in[worker_id] = CheckIn(request.has_state, step, _now(now),
                                                     uncertain=request.has_state and request.uncertain)
            self._form_recovery_plan_if_ready(_now(now))
        answer = self.wait_plan(worker_id)
        return (answer or WaitPlanReply.wait()).to_body()

    def _member_failed(self, worker_id: str, returncode: int, now: float) -> dict[str, Any]:
        """A member (or a joiner of the plan in flight) died: recover without it, unless nobody is left."""
        logger.warning("worker %s of generation %s died (exit code %s)", worker_id, self.generation, returncode)
        recovery = self.recovery or self._begin_recovery(now)
        recovery.mark_dead(worker_id)
        self.record_failure({"kind": "worker", "outcome": "died", "worker_id": worker_id, "returncode": returncode,
                             "generation": self.generation, "failure_id": recovery.failure_id}, now)
        if self.replace_failed:
            self._queue_replacement(now)
        if not recovery.survivors:
            self._fail_job(f"every worker of generation {self.generation} died", now)
            return {"expected": False, "recovering": False}
        self._form_recovery_plan_if_ready(now)
        return {"expected": False, "recovering": True, "failed_generations": list(recovery.failed_generations)}

    def _begin_recovery(self, now: float) -> Recovery:
        """Fail the current generation and the plan in flight (its joiners survive without state)."""
        failed, survivors, previous = [self.generation], list(self.member_ids), list(self.member_ids)
        interrupted, dead = self.in_flight, []
        if interrupted is not None:
            dead = list(interrupted.failure["dead"]) if interrupted.failure else []  # a recovery's, not carried out
            plan = interrupted.plan
            failed.append(plan.generation)
            # the plan's members: not its leavers, nor members that died before it (a recovery plan in flight)
            survivors = [w for w in survivors if w in plan.members and w not in plan.leavers] + list(plan.joiners)
            previous = list(plan.members)
            self._record_adjustment_failure(interrupted, plan.request_id, "interrupted by a worker's death")
            self.in_flight = None
        self.recovery = Recovery(
            failure_id=f"f{self.next_failure}", failed_generations=failed, previous_members=previous,
            survivors=survivors, detected_at=now, deadline=now + DEFAULT_RECOVERY_TIMEOUT_S, dead=dead,
            interrupted_request=None if interrupted is None else interrupted.plan.request_id,
        )
        self.next_failure += 1
        return self.recovery

    def _queue_replacement(self, now: float) -> None:
        if self.finished:
            return
        request = ScaleRequest(request_id="", action="add", count=1, size=None, at_step=None)
        request.add_count = 1
        reply = self._queue(request, now)
        logger.info("replacement %s requested (%s)", ", ".join(reply["new_workers"]), reply["request_id"])

    def _declare_silent_survivors_dead(self, now: float) -> list[str]:
        """Survivors that did not check in by the deadline are hung: dead to the job (the launcher stops them)."""
        recovery = self.recovery
        if recovery is None or now < recovery.deadline:
            return []
        silent = recovery.missing()
        for worker in silent:
            logger.warning("worker %s did not check in after the failure %s: declared dead", worker,
                           recovery.failure_id)
            recovery.mark_dead(worker)
        if silent and not recovery.survivors:
            self._fail_job(f"no survivor checked in after {recovery.failure_id}", now)
        elif silent:
            self._form_recovery_plan_if_ready(now)
        return silent

    def _form_recovery_plan_if_ready(self, now: float) -> None:
        recovery = self.recovery
        if recovery is None:
            return
        replacements = self._replacements_for(recovery, now)
        if replacements is None or recovery.missing():
            return
        self.pending = [r for r in self.pending if not set(r.new_workers) & set(replacements)]
        try:
            plan = recovery_plan(recovery, self.generation, replacements,
                                 {w: self._host_of(w) for w in [*recovery.checked_in, *replacements]},
                                 {w: self._topology_of(w) for w in [*recovery.checked_in, *replacements]})
        except ValueError as error:
            self._fail_job(str(error), now)
            return
        self.left_workers.extend(w for w in recovery.dead if w not in self.left_workers)
        for worker in recovery.dead:
            self.pending_workers.pop(worker, None)
        failure = {"failure_id": recovery.failure_id, "dead": list(recovery.dead),
                   "failed_generations": list(recovery.failed_generations), "detected_at": recovery.detected_at,
                   "recovered_at": now, "step_redone": plan.step + 1,
                   "interrupted_request": recovery.interrupted_request}
        checked = max(c.at for c in recovery.checked_in.values())
        self.in_flight = Adjustment(plan, recovery.detected_at, checked, decided_at=now, failure=failure)
        self.recovery = None
        logger.info("job %s recovers from %s (%s died): generation %d will train with %s", self.job,
                    recovery.failure_id, workers_phrase(recovery.dead), plan.generation, workers_phrase(plan.members))
        logger.debug("job %s: recovery plan %s: %s", self.job, recovery.failure_id, json.dumps(plan.to_dict()))

    def _replacements_for(self, recovery: Recovery, now: float) -> list[str] | None:
        """Ready joiners (of whole add requests) that bring the world up to ``min_workers`` ([] when not needed); None:
        keep waiting — or, past ``join_timeout_s`` since the death, the job fails (whether or not every survivor
        checked in)."""
        needed = self.min_workers - len(recovery.survivors)
        if needed <= 0:
            return []
        ready: list[str] = []
        for request in self.pending:
            if request.remove_count or request.ranks or not request.new_workers:
                continue
            if all(self.pending_workers[w].status == READY for w in request.new_workers):
                ready += request.new_workers
            if len(ready) >= needed:
                return ready
        if now - recovery.detected_at > self.join_timeout_s:
            self._fail_job(f"{plural(len(recovery.survivors), 'worker')} left after {recovery.failure_id}, fewer than "
                           f"--min-workers {self.min_workers}, and no joiner came within {self.join_timeout_s:.0f} s",
                           now)
            return None
        if not recovery.waiting_logged:
            recovery.waiting_logged = True
            logger.warning("job %s: %s left, below --min-workers %d: waiting up to %.0f s for joiners",
                           self.job, plural(len(recovery.survivors), "worker"), self.min_workers, self.join_timeout_s)
        return None

    def _fail_job(self, reason: str, now: float) -> None:
        logger.error("job %s fails: %s", self.job, reason)
        self.record_failure({"kind": "job", "outcome": "failed", "reason": reason}, now)
        self.failed_reason = reason
        self.recovery = None
        self.shutdown(f"failed: {reason}")

    def _set_failure_policy(self, replace_failed: bool, min_workers: int | None, join_timeout_s: float | None) -> None:
        if min_workers is not None and min_workers < 1:
            raise StateError(f"min_workers must be ≥ 1, got {min_workers}")
        if join_timeout_s is not None and join_timeout_s <= 0:
            raise StateError(f"join_timeout_s must be > 0, got {join_timeout_s}")
        self.replace_failed = bool(replace_failed)
        self.min_workers = min_workers or 1
        self.join_timeout_s = float(join_timeout_s or DEFAULT_JOIN_TIMEOUT_S)

    def worker_exit(self, worker_id: str, returncode: int) -> dict[str, Any]:
        """A worker exited; ``expected``: a leaver, a cancelled joiner or (after shutdown) a member, exiting 0."""
        clean = returncode == 0
        if worker_id in self.left_workers or (self.in_flight and worker_id in self.in_flight.plan.leavers):
            if clean:
                return {"expected": True}
            if not self._serves_a_joiner(worker_id):
                return {"expected": False, "left": True}  # killed after it left: the job goes on
            return self._member_failed(worker_id, returncode, time.time())
        if clean and self.member(worker_id) is not None and worker_id not in self.trained_out:
            self.trained_out.append(worker_id)
        if not clean and not self.finished and self._takes_part(worker_id):
            if self._training_over():
                logger.warning("member %s exited with code %s after a member of generation %s finished training: "
                               "the job's training is complete", worker_id, returncode, self.generation)
                return {"expected": True}
            return self._member_failed(worker_id, returncode, time.time())
        pending = self.pending_workers.get(worker_id)
        if pending is not None:
            return {"expected": self._pending_worker_exited(pending, returncode)}
        if self.member(worker_id) is not None:
            if not clean:
                logger.warning("member %s of generation %s exited with code %s", worker_id, self.generation, returncode)
            return {"expected": clean and self.finished}
        raise StateError(f"unknown worker {worker_id}")

    def _serves_a_joiner(self, worker_id: str) -> bool:
        """A leaver of the plan in flight that is a joiner's replication source (a migration): its joiner needs it."""
        return self.in_flight is not None and worker_id in self.in_flight.plan.sources.values()

    def _training_over(self) -> bool:
        """A member of the current generation exited 0 outside any adjustment: ``fit`` returned on it, and every
        member trains the same steps (the last one needed them all), so the job's training is complete."""
        return self.in_flight is None and any(self.member(worker) is not None for worker in self.trained_out)

    def _takes_part(self, worker_id: str) -> bool:
        """A member, a joiner of the plan in flight, or a survivor of the failure being recovered."""
        if self.member(worker_id) is not None:
            return True
        if self.in_flight is not None and worker_id in self.in_flight.plan.members:
            return True
        return self.recovery is not None and worker_id in self.recovery.survivors

    def shutdown(self, reason: str | None = None) -> dict[str, Any]:
        """Cancel the pending requests and mark the job finished (idempotent)."""
        if self.finished:
            return {}
        reason = reason or "shutdown"
        for request in self.pending:
            self._cancel_workers(request, f"job shut down: {reason}")
            self.record_failure(_request_failure(request, "cancelled", f"job shut down: {reason}"))
        self.pending = []
        for worker in self.standby.workers:
            self.pending_workers[worker].status = CANCELLED
            self.pending_workers[worker].reason = f"job shut down: {reason}"
        self.standby.workers = []
        self.finished = True
        self.finish_reason = reason
        return {}

    # ---- helpers -------------------------------------------------------------------------------------------------

    def _membership(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": self.member_ids}

    def _require_started(self) -> None:
        if not self.started:
            raise StateError(f"job {self.job!r} has not been started (no start_job yet)")

    def _require_running(self) -> None:
        self._require_started()
        if self.finished:
            raise StateError(f"job {self.job!r} is finished ({self.finish_reason})")

    def _require_known(self, worker_id: str) -> None:
        if not self.is_known(worker_id):
            raise StateError(f"unknown worker {worker_id}")

    def _resolve_request(
        self, action: str, count: int | None, ranks: list[int] | None, size: int | None, at_step: int | None
    ) -> ScaleRequest:
        """Validate a scale request against the projected world and turn it into adds and removals."""
        if action not in ACTIONS:
            raise StateError(f"unknown action {action!r} (expected add, remove, migrate or to)")
        _check_arguments(action, count, ranks, size)
        if at_step is not None and at_step < 0:
            raise StateError(f"at_step must be ≥ 0, got {at_step}")
        request = ScaleRequest(request_id="", action=action, count=count, size=size, at_step=at_step)
        projected = self.projected_size()
        if action == "add":
            request.add_count = _positive_count(action, count)
        elif action == "remove" and ranks is not None:
            request.ranks = self._checked_ranks(ranks, projected)
        elif action == "remove":
            request.remove_count = _removable(_positive_count(action, count), projected)
        elif action == "migrate":
            request.add_count = request.remove_count = _migratable(_positive_count(action, count), projected)
        else:
            _resize(request, size, projected)
        if projected + request.add_count > MAX_WORLD_SIZE:
            raise StateError(f"the job may have at most {MAX_WORLD_SIZE} workers (members and pending joiners): "
                             f"{projected} + {request.add_count} requested")
        return request

    def _checked_ranks(self, ranks: list[int], projected: int) -> list[int]:
        if not ranks:
            raise StateError("ranks must not be empty")
        generation = self.generation + len(self.pending)
        for rank in ranks:
            if not 0 <= rank < projected:
                raise StateError(f"rank {rank} does not exist in generation {generation} (world size {projected})")
        if len(set(ranks)) != len(ranks):
            raise StateError(f"ranks must be distinct, got {ranks}")
        if len(ranks) >= projected:
            raise StateError(f"cannot remove all {projected} workers")
        return sorted(ranks)

    def _note_ready(self, request_id: str, ready_at: float) -> None:
        request = self._pending_request(request_id)
        if request is None:
            return
        if all(self.pending_workers[worker].status == READY for worker in request.new_workers):
            request.all_reported_at = ready_at

    def _pending_request(self, request_id: str) -> ScaleRequest | None:
        return next((request for request in self.pending if request.request_id == request_id), None)

    def _decide_head(self, step: int, now: float | None) -> AdjustmentPlan | None:
        """Decide the head request if its step has come and its new workers are ready."""
        while self.pending:
            head = self.pending[0]
            if head.at_step is not None and step < head.at_step:
                return None
            if any(self.pending_workers[worker].status != READY for worker in head.new_workers):
                return None
            try:
                plan = self._make_plan(head, step)
            except StateError as error:
                self._fail_request(head, str(error))
                continue
            self.pending.pop(0)
            self.in_flight = Adjustment(plan, head.requested_at, head.all_reported_at, decided_at=_now(now),
                                        cause=head.cause)
            return plan
        return None

    def _make_plan(self, request: ScaleRequest, step: int) -> AdjustmentPlan:
        previous = self.member_ids
        leavers = self._leavers(request)
        stayers = [worker for worker in previous if worker not in leavers]
        joiners = sorted(request.new_workers, key=worker_number)
        if not stayers and not joiners:
            raise StateError(_cannot_remove_all(len(previous)))
        hosts = {worker: self._host_of(worker) for worker in previous + joiners}
        topologies = {worker: self._topology_of(worker) for worker in previous + joiners}
        sources, transfers = plan_replication(stayers, leavers, joiners, topologies)
        routes = None if transfers is None else [Transfer.from_dict(transfer) for transfer in transfers]
        return AdjustmentPlan(
            request_id=request.request_id,
            action=request.action,
            generation=self.generation + 1,
            previous_generation=self.generation,
            step=step,
            members=stayers + joiners,
            previous_members=previous,
            joiners=joiners,
            leavers=leavers,
            sources=sources,
            hosts=hosts,
            transfers=routes,
        )

    def _leavers(self, request: ScaleRequest) -> list[str]:
        """The members a request removes, resolved against the current generation, in rank order."""
        if request.workers is not None:
            return self._leaving_members(request)
        members = self.member_ids
        if request.ranks is not None:
            for rank in request.ranks:
                if rank >= len(members):
                    raise StateError(
                        f"rank {rank} does not exist in generation {self.generation} (world size {len(members)})"
                    )
            return [members[rank] for rank in sorted(request.ranks)]
        if request.remove_count > len(members):
            raise StateError(f"cannot remove {request.remove_count} of the {plural(len(members), 'worker')}")
        newest_first = sorted(self.members, key=lambda m: (m.joined_generation, worker_number(m.worker_id)))[::-1]
        leaving = {member.worker_id for member in newest_first[: request.remove_count]}
        return [worker for worker in members if worker in leaving]

    def _host_of(self, worker_id: str) -> str | None:
        member = self.member(worker_id)
        if member is not None:
            return member.host
        return self.pending_workers[worker_id].host

    def _topology_of(self, worker_id: str) -> dict[str, Any] | None:
        member = self.member(worker_id)
        if member is not None:
            return member.topology
        return self.pending_workers[worker_id].topology

    def _commit_if_new_generation(self, worker_id: str, generation: int, now: float | None) -> None:
        """A member of the in-flight plan's generation has spoken: that generation becomes current."""
        adjustment = self.in_flight
        if adjustment is None or generation != adjustment.plan.generation:
            return
        if worker_id not in adjustment.plan.members:
            return
        self._commit(adjustment, now)

    def _commit(self, adjustment: Adjustment, now: float | None) -> None:
        plan = adjustment.plan
        old_members = {member.worker_id: member for member in self.members}
        self.members = [old_members.get(worker) or self._promote(worker, plan.generation) for worker in plan.members]
        self.left_workers.extend(plan.leavers)
        self.generation = plan.generation
        adjustment.committed_at = _now(now)
        self.in_flight = None
        self.last_plan = plan
        self.progress.forget(self.member_ids)
        completing = [*self.completing, adjustment]
        for dropped in completing[:-MAX_COMPLETING]:
            missing = [worker for worker in dropped.plan.members if worker not in dropped.reports]
            self._record_adjustment_failure(
                dropped, dropped.plan.request_id, f"never completed: no report from {', '.join(missing) or 'nobody'}"
            )
        self.completing = completing[-MAX_COMPLETING:]

    def _promote(self, worker_id: str, generation: int) -> Member:
        pending = self.pending_workers.pop(worker_id)
        return Member(
            worker_id, generation, host=pending.host, device=pending.device, pid=pending.pid, topology=pending.topology
        )

    def _adjustment_to(self, generation: int) -> Adjustment | None:
        if self.in_flight is not None and self.in_flight.plan.generation == generation:
            return self.in_flight
        return next((a for a in self.completing if a.plan.generation == generation), None)

    def _complete_if_all_reported(self, adjustment: Adjustment, now: float | None) -> dict[str, Any] | None:
        if not adjustment.all_members_reported():
            return None
        record = adjustment.record(self.job, _now(now))
        self.completing.remove(adjustment)
        self.last_adjustment = record
        return record

    def _pending_worker_exited(self, pending: PendingWorker, returncode: int) -> bool:
        """Handle the exit of a joiner that is not a member yet; returns whether the exit was expected."""
        if pending.status == CANCELLED:
            del self.pending_workers[pending.worker_id]
            return returncode == 0
        if self.standby.discard(pending.worker_id):  # not replaced now: a start-up that crashed may crash again
            del self.pending_workers[pending.worker_id]
            self.record_failure({"kind": "standby", "outcome": "died", "worker_id": pending.worker_id,
                                 "returncode": returncode, "reason": f"exited with code {returncode}"})
            return False
        request = self._pending_request(pending.request_id)
        if request is None:  # its plan is decided: the adjustment will fail in the workers
            logger.error(
                "joiner %s of the decided request %s exited with code %s",
                pending.worker_id,
                pending.request_id,
                returncode,
            )
            self._record_adjustment_failure(
                self._adjustment_of(pending.request_id), pending.request_id,
                f"joiner {pending.worker_id} exited with code {returncode} after its plan was decided",
            )
            return False
        reason = f"worker {pending.worker_id} exited with code {returncode} before its plan was decided"
        self._fail_request(request, reason)
        del self.pending_workers[pending.worker_id]
        return False

    def _fail_request(self, request: ScaleRequest, reason: str) -> None:
        """Drop a pending request, cancel its new workers and keep the failure for status."""
        logger.warning("request %s (%s) failed: %s", request.request_id, request.action, reason)
        self.pending.remove(request)
        self._cancel_workers(request, f"request {request.request_id} failed: {reason}")
        self.record_failure(_request_failure(request, "failed", reason))

    def record_failure(self, failure: dict[str, Any], now: float | None = None) -> None:
        """Keep a failed or cancelled request or adjustment for ``status`` (the last ``MAX_FAILURES``).

        ``failure`` has at least ``kind`` (``request``/``adjustment``), ``outcome`` and ``reason``; the time and the
        job's last known step are added.
        """
        entry = {**failure, "at": _now(now), "step": self.progress.step}
        self.failures = [*self.failures, entry][-MAX_FAILURES:]

    def _adjustment_of(self, request_id: str) -> Adjustment | None:
        """The decided adjustment of ``request_id`` (in flight or still completing), if any."""
        candidates = [self.in_flight, *self.completing]
        return next((a for a in candidates if a is not None and a.plan.request_id == request_id), None)

    def _record_adjustment_failure(self, adjustment: Adjustment | None, request_id: str, reason: str) -> None:
        plan = None if adjustment is None else adjustment.plan
        self.record_failure({
            "kind": "adjustment",
            "outcome": "failed",
            "request_id": request_id,
            "action": None if plan is None else plan.action,
            "generation": None if plan is None else plan.generation,
            "workers": [] if plan is None else list(plan.joiners),
            "reason": reason,
        })

    def _cancel_workers(self, request: ScaleRequest, reason: str) -> None:
        for worker in request.new_workers:
            pending = self.pending_workers.get(worker)
            if pending is not None and pending.status in WAITING_STATUSES:
                pending.status = CANCELLED
                pending.reason = reason

    # ---- leave: a worker asks to be removed (it received SIGTERM) ------------------------------------------------

    def request_leave(self, worker_id: str, now: float | None = None,
                      cause: dict[str, Any] | None = None) -> dict[str, Any]:
        """``worker_id`` asks to leave the job (a preemption notice, a pod being stopped); returns ``{outcome,
        request_id}`` (``LeaveReply``).

        * A member — or a joiner of the plan in flight, a member once it commits — is queued for removal
          (``queued``): one ``leave`` request with ``workers`` at the head of the queue, ahead of the scale requests
          (a preempted worker must not wait for a joiner still warming up), decided at the next coordination; the
          leaves that arrive before it is decided join it, so a whole node drained at once leaves in one adjustment.
          Scale requests behind it resolve against the generation it leaves (a queued ``remove rank:R`` may no longer
          name a rank, and then fails). A worker already leaving (queued, or a leaver of the plan in flight) gets the
          same answer again.
        * A joiner whose plan is not decided is cancelled with its request (``cancelled``): its ``wait_plan`` answers
          ``cancelled``, its partner joiners are cancelled too, and its exit 0 is expected.
        * A finished (or shut down) job answers ``finished``: there is nothing to leave.

        Refused (``StateError``): an unknown worker, one that has left, and the last member that would stay.
        """
        self._require_started()
        if self.finished:
            return {"outcome": LEAVE_FINISHED, "request_id": None}
        if self.member(worker_id) is None:
            pending = self.pending_workers.get(worker_id)
            if pending is None:
                if worker_id in self.left_workers:
                    raise StateError(f"worker {worker_id} has left the job")
                raise StateError(f"unknown worker {worker_id}")
            in_flight = self.in_flight is not None and worker_id in self.in_flight.plan.joiners
            if not in_flight:
                return self._cancel_joiner(pending, now)
        if self.in_flight is not None and worker_id in self.in_flight.plan.leavers:
            return {"outcome": LEAVE_QUEUED, "request_id": self.in_flight.plan.request_id}
        queued = next((r for r in self.pending if r.workers is not None and worker_id in r.workers), None)
        if queued is not None:
            return {"outcome": LEAVE_QUEUED, "request_id": queued.request_id}
        staying = [worker for worker in self._members_once_committed() if not self._leave_queued(worker)]
        if staying == [worker_id]:
            raise StateError(f"worker {worker_id} is the last member of job {self.job!r}: it cannot leave")
        head = self.pending[0] if self.pending else None
        if head is not None and head.action == LEAVE and head.workers is not None:
            head.workers.append(worker_id)
            return {"outcome": LEAVE_QUEUED, "request_id": head.request_id}
        request = ScaleRequest(f"r{self.next_request}", LEAVE, workers=[worker_id], requested_at=_now(now),
                               cause=cause)
        request.all_reported_at = request.requested_at
        self.next_request += 1
        self.pending.insert(0, request)
        return {"outcome": LEAVE_QUEUED, "request_id": request.request_id}

    def _members_once_committed(self) -> list[str]:
        """The members once the plan in flight (if any) commits."""
        return list(self.in_flight.plan.members) if self.in_flight is not None else self.member_ids

    def _leave_queued(self, worker_id: str) -> bool:
        return any(request.workers is not None and worker_id in request.workers for request in self.pending)

    def _cancel_joiner(self, pending: PendingWorker, now: float | None) -> dict[str, Any]:
        """A joiner that is not part of a decided plan asks to leave: its request is cancelled (idempotent); a
        standby leaves the pool, which starts another."""
        if pending.status == CANCELLED:
            return {"outcome": LEAVE_CANCELLED, "request_id": pending.request_id}
        if self.standby.discard(pending.worker_id):
            self._cancel_standby(pending.worker_id, "was asked to stop (SIGTERM)")
            self._refill_standby()
            return {"outcome": LEAVE_CANCELLED, "request_id": None}
        request = self._pending_request(pending.request_id)
        if request is None:  # not pending, not in flight: never happens (a decided joiner is in flight or a member)
            raise StateError(f"joiner {pending.worker_id} of request {pending.request_id} cannot leave now")
        reason = f"its joiner {pending.worker_id} was asked to stop (SIGTERM) before the plan was decided"
        logger.warning("request %s (%s) cancelled: %s", request.request_id, request.action, reason)
        self.pending.remove(request)
        self._cancel_workers(request, f"request {request.request_id} cancelled: {reason}")
        self.record_failure(_request_failure(request, "cancelled", reason), now)
        return {"outcome": LEAVE_CANCELLED, "request_id": request.request_id}

    def _leaving_members(self, request: ScaleRequest) -> list[str]:
        """The members a ``leave`` request removes (those still members), in rank order."""
        workers = request.workers or []
        leaving = [worker for worker in self.member_ids if worker in workers]
        if not leaving:
            raise StateError(f"{_named(workers)} asked to leave but {'is' if len(workers) == 1 else 'are'} no "
                             f"longer {'a member' if len(workers) == 1 else 'members'}")
        return leaving


def _now(now: float | None) -> float:
    return time.time() if now is None else now


def _request_failure(request: ScaleRequest, outcome: str, reason: str) -> dict[str, Any]:
    """A failed (``failed``) or cancelled (``cancelled``) request as ``status`` lists it."""
    return {
        "kind": "request",
        "outcome": outcome,
        "request_id": request.request_id,
        "action": request.action,
        "count": request.count,
        "ranks": request.ranks,
        "size": request.size,
        "at_step": request.at_step,
        "new_workers": list(request.new_workers),
        "workers": request.workers,
        "requested_at": request.requested_at,
        "reason": reason,
    }


def _stored_report(report: AdjustmentReport, reported_at: float) -> dict[str, Any]:
    """A report as the adjustment keeps it (and persists it): every field but who sent it, plus when it arrived."""
    stored = report.to_body()
    del stored["worker_id"], stored["generation"]
    return {**stored, "reported_at": reported_at}


def _checked_topology(worker_id: str, topology: Any) -> dict[str, Any] | None:
    """A registered topology as a plain dict, or None (logged) when it is not one the planner can read."""
    if topology is None:
        return None
    try:
        return WorkerTopology.coerce(topology).to_dict()
    except (TypeError, ValueError, AttributeError) as error:
        logger.warning("worker %s registered an unreadable topology (%s): ignored", worker_id, error)
        return None


def _member_of(enrollee: Enrollee) -> Member:
    return Member(enrollee.worker_id, 0, host=enrollee.host, pid=enrollee.pid)


def _initial_hosts(worker_ids: list[str], hosts: Any) -> dict[str, str]:
    """``hosts`` of start_job: one host per rank (list) or a worker → host mapping."""
    if hosts is None:
        return {}
    if isinstance(hosts, dict):
        unknown = sorted(set(hosts) - set(worker_ids))
        if unknown:
            raise StateError(f"hosts names unknown workers {unknown}")
        named = dict(hosts)
    elif len(hosts) != len(worker_ids):
        raise StateError(f"hosts must list one host per worker: got {len(hosts)} for nproc {len(worker_ids)}")
    else:
        named = dict(zip(worker_ids, hosts, strict=True))
    if not all(host is None or isinstance(host, str) for host in named.values()):
        raise StateError("hosts must be host names (strings)")
    return named


def _require_non_negative(**values: int | None) -> None:
    """Refuse a negative generation or step (never sent by a worker)."""
    for name, value in values.items():
        if value is not None and value < 0:
            raise StateError(f"{name} must be ≥ 0, got {value}")


def _check_arguments(action: str, count: int | None, ranks: list[int] | None, size: int | None) -> None:
    """Refuse arguments that do not belong to the action."""
    if ranks is not None and action != "remove":
        raise StateError(f"ranks only apply to remove, not to {action}")
    if ranks is not None and count is not None:
        raise StateError("remove takes a count or ranks, not both")
    if size is not None and action != "to":
        raise StateError(f"size only applies to to, not to {action}")
    if action == "to" and count is not None:
        raise StateError("to takes a size, not a count")
    if action == "to" and size is None:
        raise StateError("to needs a size")


def _positive_count(action: str, count: int | None) -> int:
    if count is None:
        raise StateError(f"{action} needs a count" + (" or ranks" if action == "remove" else ""))
    if count < 1:
        raise StateError(f"count must be ≥ 1, got {count}")
    return count


def _removable(count: int, projected: int) -> int:
    if count == projected:
        raise StateError(_cannot_remove_all(projected))
    if count > projected:
        raise StateError(f"cannot remove {plural(count, 'worker')}: the job has only {projected}")
    return count


def _cannot_remove_all(count: int) -> str:
    """``cannot remove all 3 workers`` / ``cannot remove the only worker``."""
    return f"cannot remove all {count} workers" if count != 1 else "cannot remove the only worker"


def _named(workers: list[str]) -> str:
    """``worker w3`` / ``workers w3 and w4``."""
    return f"{'worker' if len(workers) == 1 else 'workers'} {workers_phrase(workers)}"


def _migratable(count: int, projected: int) -> int:
    if count > projected:
        raise StateError(f"cannot migrate {plural(count, 'worker')}: the job has only {projected}")
    return count


def _resize(request: ScaleRequest, size: int | None, projected: int) -> None:
    """Turn ``to size`` into an add or a newest-first removal against the projected size."""
    if size is None or size < 1:
        raise StateError(f"size must be ≥ 1, got {size}")
    if size == projected:
        raise StateError(f"the job already has {plural(projected, 'worker')} (counting pending requests); nothing to "
                         "do")
    if size > projected:
        request.add_count = size - projected
    else:
        request.remove_count = projected - size
