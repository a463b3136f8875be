"""A worker asks to leave (it received SIGTERM): every transition that queues a ``leave`` request at the head of the
queue or cancels a joiner that asked to leave. The leave is decided and resolved against the members by
``adjustments.py``."""

from __future__ import annotations

import logging
from typing import Any

from lightning_elan.master.state import (
    CANCELLED,
    LEAVE,
    JobState,
    PendingWorker,
    ScaleRequest,
    StateError,
    now_or_clock,
)
from lightning_elan.master.transitions import pool, requests
from lightning_elan.protocol.contract import LEAVE_CANCELLED, LEAVE_FINISHED, LEAVE_QUEUED, LeaveReply

logger = logging.getLogger(__name__)

__all__ = ["request_leave"]


def request_leave(state: JobState, worker_id: str, now: float | None = None,
                  cause: dict[str, Any] | None = None) -> LeaveReply:
    """``worker_id`` asks to leave the job (a preemption notice, a pod being stopped); returns the outcome and the
    request that carries it out.

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
    state.require_started()
    if state.finished:
        return LeaveReply(LEAVE_FINISHED, None)
    if state.member(worker_id) is None:
        pending = state.pending_workers.get(worker_id)
        if pending is None:
            if worker_id in state.left_workers:
                raise StateError(f"worker {worker_id} has left the job")
            raise StateError(f"unknown worker {worker_id}")
        in_flight = state.in_flight is not None and worker_id in state.in_flight.plan.joiners
        if not in_flight:
            return _cancel_joiner(state, pending, now)
    if state.in_flight is not None and worker_id in state.in_flight.plan.leavers:
        return LeaveReply(LEAVE_QUEUED, state.in_flight.plan.request_id)
    queued = next((r for r in state.pending if r.workers is not None and worker_id in r.workers), None)
    if queued is not None:
        return LeaveReply(LEAVE_QUEUED, queued.request_id)
    staying = [worker for worker in _members_once_committed(state) if not _leave_queued(state, worker)]
    if staying == [worker_id]:
        raise StateError(f"worker {worker_id} is the last member of job {state.job!r}: it cannot leave")
    head = state.pending[0] if state.pending else None
    if head is not None and head.action == LEAVE and head.workers is not None:
        head.workers.append(worker_id)
        return LeaveReply(LEAVE_QUEUED, head.request_id)
    request = ScaleRequest(state.new_request_id(), LEAVE, workers=[worker_id], requested_at=now_or_clock(now),
                           cause=cause)
    request.all_reported_at = request.requested_at
    state.pending.insert(0, request)
    return LeaveReply(LEAVE_QUEUED, request.request_id)


def _members_once_committed(state: JobState) -> list[str]:
    """The members once the plan in flight (if any) commits."""
    return list(state.in_flight.plan.members) if state.in_flight is not None else state.member_ids


def _leave_queued(state: JobState, worker_id: str) -> bool:
    return any(request.workers is not None and worker_id in request.workers for request in state.pending)


def _cancel_joiner(state: JobState, pending: PendingWorker, now: float | None) -> LeaveReply:
    """A joiner that is not part of a decided plan asks to leave: its request is cancelled (idempotent); a
    standby leaves the pool, which starts another."""
    if pending.status == CANCELLED:
        return LeaveReply(LEAVE_CANCELLED, pending.request_id)
    if state.standby.discard(pending.worker_id):
        pool.cancel(state, pending.worker_id, "was asked to stop (SIGTERM)")
        pool.refill(state)
        return LeaveReply(LEAVE_CANCELLED, None)
    request = state.pending_request(pending.request_id)
    if request is None:  # not pending, not in flight: never happens (a decided joiner is in flight or a member)
        raise StateError(f"joiner {pending.worker_id} of request {pending.request_id} cannot leave now")
    reason = f"its joiner {pending.worker_id} was asked to stop (SIGTERM) before the plan was decided"
    logger.warning("request %s (%s) cancelled: %s", request.request_id, request.action, reason)
    state.pending.remove(request)
    requests.cancel_workers(state, request, f"request {request.request_id} cancelled: {reason}")
    state.record_failure(requests.request_failure(request, "cancelled", reason), now)
    return LeaveReply(LEAVE_CANCELLED, request.request_id)
