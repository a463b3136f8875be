"""Workers started by a scheduler (``elan worker``) enrol with the AM; the job starts once enough have.

``elan am --min-workers N --max-workers M``: the job's generation 0 is made of the workers that enrolled before it
started — as soon as ``M`` have, or ``start_grace_s`` after the ``N``-th did (torchrun's ``--nnodes MIN:MAX`` with
its last-call wait). A waiting worker polls; one silent for ``silence_s`` is dropped before the start. After the
start a worker that enrols is a joiner (the AM queues an ``add`` request for it). Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_START_GRACE_S = 5.0
"""After ``min_workers`` have enrolled, the job waits this long for more (up to ``max_workers``), then starts."""
DEFAULT_SILENCE_S = 15.0
"""A waiting worker that has not polled this long is dropped before the job starts."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
"""Once the job runs, a worker whose ``elan worker`` has not polled this long is lost (``master/heartbeats.py``)."""
MIN_HEARTBEAT_TIMEOUT_S = 15.0
"""``elan worker`` polls every 5 s; the AM finds itself cut off after 7 s without any poll
(``heartbeats.DEAF_S``): a shorter timeout would take a late poll, or the AM's own network, for a lost host."""


@dataclass
class Enrollee:
    """A worker waiting for the job to start."""

    worker_id: str
    host: str
    pid: int
    enrolled_at: float
    last_seen: float


@dataclass
class Enrolment:
    """The job's enrolment rule and the workers waiting for its start."""

    min_workers: int
    max_workers: int
    start_grace_s: float = DEFAULT_START_GRACE_S
    silence_s: float = DEFAULT_SILENCE_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    waiting: list[Enrollee] = field(default_factory=list)  # in enrolment order: generation 0's rank order
    quorum_at: float | None = None  # when min_workers were first waiting

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be ≥ 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(f"--max-workers {self.max_workers} is less than --min-workers {self.min_workers}")
        if self.start_grace_s < 0 or self.silence_s <= 0:
            raise ValueError("start_grace_s must be ≥ 0 and silence_s > 0")
        if self.heartbeat_timeout_s < MIN_HEARTBEAT_TIMEOUT_S:
            raise ValueError(f"--heartbeat-timeout must be ≥ {MIN_HEARTBEAT_TIMEOUT_S:g} s (`elan worker` polls every "
                             f"5 s), got {self.heartbeat_timeout_s:g}")

    def enrol(self, worker_id: str, host: str, pid: int, now: float) -> None:
        self.waiting.append(Enrollee(worker_id, host, pid, now, now))
        self._note_quorum(now)

    def is_full(self) -> bool:
        return len(self.waiting) >= self.max_workers

    def seen(self, worker_id: str, now: float) -> bool:
        """A waiting worker polled; False if it is not waiting (dropped, or never enrolled)."""
        enrollee = self.find(worker_id)
        if enrollee is not None:
            enrollee.last_seen = now
        return enrollee is not None

    def find(self, worker_id: str) -> Enrollee | None:
        return next((e for e in self.waiting if e.worker_id == worker_id), None)

    def drop_silent(self, now: float) -> list[str]:
        """Forget waiting workers that stopped polling; returns their ids."""
        silent = [e.worker_id for e in self.waiting if now - e.last_seen > self.silence_s]
        self.waiting = [e for e in self.waiting if e.worker_id not in silent]
        if len(self.waiting) < self.min_workers:
            self.quorum_at = None
        return silent

    def starting_members(self, now: float) -> list[Enrollee] | None:
        """Generation 0 if the job should start now (full, or the grace after the quorum is over), else None."""
        self._note_quorum(now)
        if self.is_full() or (self.quorum_at is not None and now - self.quorum_at >= self.start_grace_s):
            return list(self.waiting[: self.max_workers])
        return None

    def _note_quorum(self, now: float) -> None:
        if self.quorum_at is None and len(self.waiting) >= self.min_workers:
            self.quorum_at = now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Enrolment:
        waiting = [Enrollee(**item) for item in data.get("waiting", [])]
        return cls(**{**data, "waiting": waiting})
