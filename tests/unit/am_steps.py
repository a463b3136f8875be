"""Steps the AM's transition tests share: a started job, joiners reporting ready, a coordination that decides and one
that commits, a worker's exit as the launcher reports it (pure state: no sockets, no processes)."""

from __future__ import annotations

from typing import Any

from lightning_elan.master.state import JobState
from lightning_elan.master.transitions import adjustments, launching, recovering, requests
from lightning_elan.protocol.contract import (
    AdjustmentPlan,
    CoordinateRequest,
    RegisterRequest,
    WorkerExitReply,
    WorkerExitRequest,
)


def started(nproc: int = 3, **options: Any) -> JobState:
    """A job of ``elan run`` started with ``nproc`` members (w0…)."""
    state = JobState(job="job")
    launching.start_job(state, nproc, **options)
    return state


def ready(state: JobState, *workers: str, now: float | None = None) -> None:
    """The workers register (a joiner's *report ready*)."""
    for worker in workers:
        requests.register(state, RegisterRequest(worker, host="host", device="cpu", pid=100), now=now)


def decide(state: JobState, step: int = 10) -> AdjustmentPlan:
    """Rank 0 coordinates and the AM decides a plan (it must)."""
    reply = adjustments.coordinate(state, CoordinateRequest(state.member_ids[0], state.generation, step))
    assert reply.plan is not None, reply
    return reply.plan


def commit(state: JobState, plan: AdjustmentPlan, step: int = 11) -> None:
    """A member of the plan's generation coordinates: the plan is committed."""
    adjustments.coordinate(state, CoordinateRequest(plan.members[0], plan.generation, step))


def exited(state: JobState, worker: str, returncode: int, **store_marks: bool) -> WorkerExitReply:
    """The launcher reports ``worker``'s exit, with what the rendezvous store said of it (``training_ended``,
    ``script_failed``)."""
    return recovering.worker_exit(state, WorkerExitRequest(worker, returncode, **store_marks))
