"""The standby pool (``elan run --standby K``): every transition that adds workers to it, takes them out or cancels
them. The pool's bookkeeping is ``master/standby.py``; its workers' statuses are the job state's pending workers."""

from __future__ import annotations

import logging

from lightning_elan.master.standby import STANDBY_REQUEST
from lightning_elan.master.state import CANCELLED, READY, REQUESTED, SPAWNED, JobState, PendingWorker, named
from lightning_elan.protocol.contract import WaitPlanReply

logger = logging.getLogger(__name__)

__all__ = ["cancel", "cancel_pool", "drop_unreported", "exited", "idle_answer", "refill", "take"]

_READINESS = {READY: 2, SPAWNED: 1, REQUESTED: 0}  # higher: taken first


def refill(state: JobState) -> None:
    """Start workers until the standby pool is back at its target (the launcher spawns them at its next poll)."""
    if state.finished:
        return
    for worker in state.new_worker_ids(state.standby.missing()):
        state.pending_workers[worker] = PendingWorker(worker, STANDBY_REQUEST)
        state.standby.workers.append(worker)


def take(state: JobState, count: int, request_id: str) -> list[str]:
    """Up to ``count`` standbys for a request, ready ones first; they become the request's new workers."""
    taken = state.standby.take(count, lambda worker: _READINESS.get(state.pending_workers[worker].status, -1))
    for worker in taken:
        state.pending_workers[worker].request_id = request_id
    if taken:
        logger.info("job %s: request %s takes standby %s", state.job, request_id, named(taken))
    return taken


def cancel(state: JobState, worker_id: str, reason: str) -> None:
    """Cancel a standby that already left the pool (it exits 0); kept in ``failures`` for status."""
    pending = state.pending_workers[worker_id]
    pending.status, pending.reason = CANCELLED, f"standby {worker_id} {reason}"
    logger.warning("job %s: standby %s %s", state.job, worker_id, reason)
    state.record_failure({"kind": "standby", "outcome": "cancelled", "worker_id": worker_id, "reason": reason})


def drop_unreported(state: JobState, now: float) -> list[str]:
    """Standbys started more than ``report_timeout_s`` ago that never reported: stopped (not replaced until the
    next ``add``: a start-up that fails may fail again)."""
    late = [worker for worker in state.standby.workers if state.pending_workers[worker].status == SPAWNED
            and now - (state.pending_workers[worker].spawned_at or now) > state.report_timeout_s]
    for worker in late:
        state.standby.discard(worker)
        cancel(state, worker, f"did not report ready within {state.report_timeout_s:.0f} s")
    return late


def exited(state: JobState, worker_id: str, returncode: int) -> bool:
    """A worker exited: if it was a standby it leaves the pool (not replaced now: a start-up that crashed may crash
    again); returns whether it was one."""
    if not state.standby.discard(worker_id):
        return False
    del state.pending_workers[worker_id]
    state.record_failure({"kind": "standby", "outcome": "died", "worker_id": worker_id, "returncode": returncode,
                          "reason": f"exited with code {returncode}"})
    return True


def cancel_pool(state: JobState, reason: str) -> None:
    """The job shuts down: every standby is cancelled (each exits 0) and the pool is emptied."""
    for worker in state.standby.workers:
        state.pending_workers[worker].status = CANCELLED
        state.pending_workers[worker].reason = reason
    state.standby.workers = []


def idle_answer(state: JobState, worker_id: str) -> WaitPlanReply:
    """What a long poll with nothing decided answers: ``standby`` to a worker of the pool, else ``wait``."""
    pending = state.pending_workers.get(worker_id)
    if pending is not None and pending.request_id == STANDBY_REQUEST and pending.status != CANCELLED:
        return WaitPlanReply.standby()
    return WaitPlanReply.wait()
