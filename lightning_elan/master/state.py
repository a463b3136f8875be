"""The job state of the application master: its data, its queries and its persisted form (pure: no sockets, no
files, no torch).

``JobState`` is what the AM persists (``to_dict``/``from_dict``) and the transaction boundary: the server loads it,
applies one transition and saves it. The transitions live in :mod:`lightning_elan.master.transitions`, one family per
module (requests and the queue, the standby pool, leaving, adjustments, whether the job is done, recovery, enrolment,
the launcher's job, status); each validates its input first and raises ``StateError`` with a message for the client.
Semantics: docs/architecture.md, *Semantics of the AM*.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.measure import Measurements
from lightning_elan.master.narration import workers_phrase
from lightning_elan.master.recovery import Recovery
from lightning_elan.master.sizing_state import SizingState
from lightning_elan.master.standby import StandbyPool
from lightning_elan.protocol.contract import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_REPORT_TIMEOUT_S,
    AdjustmentPlan,
)

logger = logging.getLogger(__name__)

LEAVE = "leave"  # the action of the requests a worker's ``leave`` queues (not a ``scale`` action)
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
class WorkerExit:
    """How a worker's process ended, as its launcher reported it (``worker_exit``): what decides whether the job's
    training is complete (``transitions/finishing.py``, from the exits of the members)."""

    returncode: int
    training_ended: bool = False  # its training loop had ended (the store's ``training_ended_key``)
    script_failed: bool = False  # an uncaught exception ended its script (the store's ``script_failed_key``)
    left: bool = False  # it exited 0 as a leaver the AM waited for
    lost: bool = False  # recorded by the AM for a lost worker (``recovering.worker_lost``): its real exit is to come

    @property
    def trained_out(self) -> bool:
        """It exited 0 outside any adjustment: ``fit`` returned on it."""
        return self.returncode == 0 and not self.left

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerExit:
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
    """A queued scale request, resolved at request time into workers to add and a removal rule (a ``to`` or a
    ``migrate`` is resolved again against the members when it is decided: ``transitions/resolving.py``)."""

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
    replaces: str | None = None  # the dead member an ``add 1`` of ``--replace-failed`` replaces

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
    live_reshard: bool = False  # the members hold shards: the leavers take part in the plan until they report

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
            "pause_s": {worker: self._report(worker).get("pause_s") for worker in plan.stayers},
            "joiner_startup_s": {worker: self._report(worker).get("startup_s") for worker in plan.joiners},
            "received": {
                worker: {"source": self._report(worker).get("received_from"),
                         "route": self._report(worker).get("received_over"),
                         "in_place_bytes": self._report(worker).get("bytes_in_place"),
                         "prefaulted": self._report(worker).get("prefaulted")}
                for worker in plan.joiners
            },
            **self._scaling_outcome(),
            **({"unreported": unreported} if (unreported := self.unreported()) else {}),
            **({"failure": self.failure} if self.failure else {}),
            **({"cause": self.cause} if self.cause else {}),
        }

    def unreported(self) -> list[str]:
        """Members that never reported this adjustment (a recovery cut it short: they died or recovered first)."""
        return [worker for worker in self.plan.members if worker not in self.reports]

    def _report(self, worker: str) -> dict[str, Any]:
        return self.reports.get(worker, {})

    def _scaling_outcome(self) -> dict[str, Any]:
        """The global batch and scaling decision the new members report they applied (they must all agree)."""
        applied = {
            worker: (self.reports[worker].get("global_batch"), self.reports[worker].get("scaling"))
            for worker in self.plan.members if worker in self.reports
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
    unjoined_replacements: dict[str, int] = field(default_factory=dict)  # replacement → its place in a failing chain
    min_workers: int = 1  # below this many survivors the recovery waits for joiners
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S  # how long it waits for them before the job fails
    failed_reason: str | None = None  # why the job stopped unfinished (no survivor, too few workers)
    next_failure: int = 1
    launch_world_size: int = 0  # generation 0's size: a joiner's model is built for it before it joins
    exits: dict[str, WorkerExit] = field(default_factory=dict)  # every worker whose process exited, and how
    declared_dead: list[str] = field(default_factory=list)  # silent survivors declared dead (their process is killed)
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
            "unjoined_replacements": dict(self.unjoined_replacements),
            "min_workers": self.min_workers,
            "join_timeout_s": self.join_timeout_s,
            "failed_reason": self.failed_reason,
            "next_failure": self.next_failure,
            "launch_world_size": self.launch_world_size,
            "exits": {worker: how.to_dict() for worker, how in self.exits.items()},
            "declared_dead": list(self.declared_dead),
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
            unjoined_replacements=dict(data.get("unjoined_replacements", {})),
            min_workers=data.get("min_workers", 1),
            join_timeout_s=data.get("join_timeout_s", DEFAULT_JOIN_TIMEOUT_S),
            failed_reason=data.get("failed_reason"),
            next_failure=data.get("next_failure", 1),
            launch_world_size=data.get("launch_world_size", 0),
            exits=_exits_from_dict(data),
            declared_dead=list(data.get("declared_dead", [])),
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
        """World size once every pending request has applied: a ``to N`` leaves N whatever the size before it (it is
        resolved again against the members when it is decided), the others change the size by their count."""
        size = self.world_size
        for request in self.pending:
            size = request.size if request.action == "to" and request.size else size + request.size_change
        return size

    def member(self, worker_id: str) -> Member | None:
        return next((member for member in self.members if member.worker_id == worker_id), None)

    def is_known(self, worker_id: str) -> bool:
        return self.member(worker_id) is not None or worker_id in self.pending_workers or worker_id in self.left_workers

    def pending_request(self, request_id: str) -> ScaleRequest | None:
        """The queued request ``request_id``, if it is still queued."""
        return next((request for request in self.pending if request.request_id == request_id), None)

    def host_of(self, worker_id: str) -> str | None:
        """The host a member or a pending worker registered."""
        member = self.member(worker_id)
        return member.host if member is not None else self.pending_workers[worker_id].host

    def topology_of(self, worker_id: str) -> dict[str, Any] | None:
        """The topology a member or a pending worker registered."""
        member = self.member(worker_id)
        return member.topology if member is not None else self.pending_workers[worker_id].topology

    @property
    def trained_out(self) -> list[str]:
        """The workers that exited 0 outside any adjustment (``fit`` returned on them, if they were members)."""
        return [worker for worker, how in self.exits.items() if how.trained_out]

    def cancelled_workers(self) -> list[str]:
        """Joiners cancelled (a failed request, the job's shutdown) that the AM has not seen exit: each learns it
        from its next ``wait_plan``, so an AM of ``elan worker``s serves on a while for them."""
        return [worker for worker, pending in self.pending_workers.items() if pending.status == CANCELLED]

    def unreported_leavers(self) -> list[str]:
        """In a job of ``elan worker``s, the workers that left it (or died) whose ``elan worker`` has not reported their
        exit yet: it reads the store the AM serves and reports to the AM, so the AM serves on for them a while. A lost
        worker too: if its host comes back meanwhile, its ``elan worker`` learns from the AM to kill its command
        (with the AM gone, that command would wait on the store that went with it)."""
        if self.enrolment is None:
            return []
        lost = [worker for worker, how in self.exits.items() if how.lost]
        return [worker for worker in self.left_workers if worker not in self.exits] + lost

    def training_over(self) -> bool:
        """A member of the current generation exited 0 outside any adjustment: ``fit`` returned on it, and every
        member trains the same steps (the last one needed them all), so the job's training is complete."""
        return self.in_flight is None and any(self.member(worker) is not None for worker in self.trained_out)

    def require_started(self) -> None:
        if not self.started:
            raise StateError(f"job {self.job!r} has not been started (no start_job yet)")

    def require_running(self) -> None:
        self.require_started()
        if self.finished:
            raise StateError(f"job {self.job!r} is finished ({self.finish_reason})")

    def require_known(self, worker_id: str) -> None:
        if not self.is_known(worker_id):
            raise StateError(f"unknown worker {worker_id}")

    # ---- what every family of transitions records --------------------------------------------------------------

    def new_worker_ids(self, count: int) -> list[str]:
        """Allocate ``count`` fresh worker ids (``w<n>``, never reused)."""
        ids = [f"w{self.next_worker + index}" for index in range(count)]
        self.next_worker += count
        return ids

    def new_request_id(self) -> str:
        """Allocate a fresh request id (``r<n>``, never reused)."""
        request_id = f"r{self.next_request}"
        self.next_request += 1
        return request_id

    def record_failure(self, failure: dict[str, Any], now: float | None = None) -> None:
        """Keep a failed or cancelled request or adjustment for ``status`` (the last ``MAX_FAILURES``).

        ``failure`` has at least ``kind`` (``request``/``adjustment``), ``outcome`` and ``reason``; the time and the
        job's last known step are added.
        """
        entry = {**failure, "at": now_or_clock(now), "step": self.progress.step}
        self.failures = [*self.failures, entry][-MAX_FAILURES:]


def _exits_from_dict(data: dict[str, Any]) -> dict[str, WorkerExit]:
    """The members' exits of a persisted state (a state saved before ``exits`` lists its ``trained_out`` members)."""
    if "exits" in data:
        return {worker: WorkerExit.from_dict(how) for worker, how in data["exits"].items()}
    return {worker: WorkerExit(0) for worker in data.get("trained_out", [])}


def now_or_clock(now: float | None) -> float:
    """``now`` when the caller gives a time (tests, the AM's own clock), else ``time.time()``."""
    return time.time() if now is None else now


def named(workers: list[str]) -> str:
    """``worker w3`` / ``workers w3 and w4``."""
    return f"{'worker' if len(workers) == 1 else 'workers'} {workers_phrase(workers)}"


def require_non_negative(**values: int | None) -> None:
    """Refuse a negative generation or step (never sent by a worker)."""
    for name, value in values.items():
        if value is not None and value < 0:
            raise StateError(f"{name} must be ≥ 0, got {value}")


def adjustment_failure(adjustment: Adjustment | None, request_id: str, reason: str) -> dict[str, Any]:
    """A failed adjustment (its joiner exited after the decision, a death interrupted it, it never completed) as
    ``status`` lists it."""
    plan = None if adjustment is None else adjustment.plan
    return {
        "kind": "adjustment",
        "outcome": "failed",
        "request_id": request_id,
        "action": None if plan is None else plan.action,
        "generation": None if plan is None else plan.generation,
        "workers": [] if plan is None else list(plan.joiners),
        "reason": reason,
    }
