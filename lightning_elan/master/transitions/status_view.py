"""The ``status`` reply: the job state rendered for ``elan status`` and the dashboards (reads only, changes
nothing)."""

from __future__ import annotations

from typing import Any

from lightning_elan.master.state import JobState, Member, ScaleRequest
from lightning_elan.protocol.contract import AMStatus, MemberStatus, StatusReply

__all__ = ["status"]


def status(state: JobState) -> StatusReply:
    """The reply to ``status`` (the server adds the AM process's part of ``am``)."""
    return StatusReply(
        job=state.job,
        generation=state.generation,
        members=[_member_summary(state, rank, member) for rank, member in enumerate(state.members)],
        finished=state.finished,
        step=state.progress.step,
        epoch=state.progress.epoch,
        position=state.progress.position,
        global_batch=state.progress.global_batch,
        scaling=state.progress.scaling,
        pending=[_pending_summary(state, request) for request in state.pending],
        in_flight=state.in_flight.plan if state.in_flight else None,
        last_adjustment=state.last_adjustment,
        failures=[dict(failure) for failure in state.failures],
        am=AMStatus(state.am_restarts),
        recovery=_recovery_summary(state),
        enrolment=_enrolment_summary(state),
        standby=_standby_summary(state),
        sizing={**state.sizing.summary(), "measured": state.measured.summary()},
        failed_reason=state.failed_reason,
        finish_reason=state.finish_reason,
    )


def _standby_summary(state: JobState) -> dict[str, Any] | None:
    """The standby pool (``elan run --standby K``): its target and its workers with their status; None without."""
    if not state.standby.target and not state.standby.workers:
        return None
    workers = [{"worker_id": worker, "status": state.pending_workers[worker].status,
                "host": state.pending_workers[worker].host} for worker in state.standby.workers]
    return {"target": state.standby.target, "workers": workers}


def _enrolment_summary(state: JobState) -> dict[str, Any] | None:
    """A job of `elan worker`s: its bounds and, before the start, the workers waiting for it (None otherwise)."""
    if state.enrolment is None:
        return None
    return {"min_workers": state.enrolment.min_workers, "max_workers": state.enrolment.max_workers,
            "started": state.started,
            "waiting": [{"worker_id": e.worker_id, "host": e.host, "pid": e.pid} for e in state.enrolment.waiting]}


def _recovery_summary(state: JobState) -> dict[str, Any] | None:
    recovery = state.recovery
    if recovery is None:
        return None
    return {"failure_id": recovery.failure_id, "dead": list(recovery.dead),
            "failed_generations": list(recovery.failed_generations), "survivors": list(recovery.survivors),
            "checked_in": sorted(recovery.checked_in), "detected_at": recovery.detected_at}


def _member_summary(state: JobState, rank: int, member: Member) -> MemberStatus:
    """One member in ``status``: where it runs and its last known step (``last_step_from`` says how it is known:
    ``coordinate`` = its last coordinate, ``report`` = its last adjustment report; None = not heard of yet)."""
    last = state.progress.workers.get(member.worker_id) or {}
    return MemberStatus(member.worker_id, rank, member.host, member.device, member.pid, member.joined_generation,
                        last.get("step"), last.get("source"), last.get("at"))


def _pending_summary(state: JobState, request: ScaleRequest) -> dict[str, Any]:
    workers = {worker: state.pending_workers[worker].status for worker in request.new_workers}
    return {**request.to_dict(), "worker_status": workers}
