"""Scale requests and the queue: every transition that changes ``pending`` (apart from the ``leave`` requests of
``leaving.py``, the head resolved again by ``resolving.py`` and the decision of ``adjustments.py``), the joiners'
progress from requested to ready, the requests that fail or are cancelled, and ``shutdown``, which cancels what is
queued."""

from __future__ import annotations

import logging
from typing import Any

from lightning_elan.master.narration import plural
from lightning_elan.master.state import (
    CANCELLED,
    READY,
    REQUESTED,
    SPAWNED,
    WAITING_STATUSES,
    Adjustment,
    JobState,
    PendingWorker,
    ScaleRequest,
    StateError,
    adjustment_failure,
    named,
    now_or_clock,
)
from lightning_elan.master.transitions import pool
from lightning_elan.protocol.contract import (
    MAX_WORLD_SIZE,
    EmptyReply,
    RegisterReply,
    RegisterRequest,
    ScaleReply,
    SpawnOrder,
)
from lightning_elan.replication.topology import WorkerTopology

logger = logging.getLogger(__name__)

__all__ = ["ACTIONS", "cancel_workers", "cannot_remove_all", "fail_request", "fail_unreported", "pending_worker_exited",
           "queue", "queue_add", "register", "request_failure", "scale", "shutdown", "spawn_requested", "start_workers"]

ACTIONS = ("add", "remove", "migrate", "to")


def scale(
    state: JobState,
    action: str,
    count: int | None = None,
    ranks: list[int] | None = None,
    size: int | None = None,
    at_step: int | None = None,
    now: float | None = None,
    cause: dict[str, Any] | None = None,
) -> ScaleReply:
    """Queue a scale request and create its new workers; returns the request's id and its new workers. ``cause``: the
    AM's own decision behind it (recorded with the adjustment)."""
    state.require_running()
    if state.in_flight is not None:
        raise StateError(
            f"adjustment in flight (generation {state.generation} → {state.in_flight.plan.generation}); retry"
        )
    if state.recovery is not None:
        raise StateError(f"recovering from the death of {', '.join(state.recovery.dead)}; retry")
    request = _resolve_request(state, action, count, ranks, size, at_step)
    request.cause = cause
    if request.add_count and state.enrolment is not None:
        raise StateError(f"the workers of job {state.job} are started by their scheduler: to add one, start another "
                         f"`elan worker --job {state.job}` (it joins by itself); `{action}` cannot start it")
    return queue(state, request, now)


def queue_add(state: JobState, now: float | None, replaces: str | None = None) -> ScaleReply:
    """Queue an ``add 1`` of the AM's own (a joiner that enrolled, a replacement for the dead member ``replaces``)."""
    request = ScaleRequest(request_id="", action="add", count=1, size=None, at_step=None, replaces=replaces)
    request.add_count = 1
    return queue(state, request, now)


def queue(state: JobState, request: ScaleRequest, now: float | None) -> ScaleReply:
    """Give a resolved request its id and new workers (standbys first) and append it to the queue."""
    request.request_id = state.new_request_id()
    request.requested_at = now_or_clock(now)
    request.new_workers = []
    start_workers(state, request, request.add_count, request.requested_at)
    state.pending.append(request)
    return ScaleReply(request.request_id, list(request.new_workers))


def start_workers(state: JobState, request: ScaleRequest, count: int, now: float) -> list[str]:
    """Give ``request`` ``count`` more new workers, standbys first (the launcher starts the others at its next poll);
    returns them. ``all_reported_at`` is ``now`` when every new worker of the request is already ready."""
    taken = pool.take(state, count, request.request_id)
    fresh = state.new_worker_ids(count - len(taken))
    for worker in fresh:
        state.pending_workers[worker] = PendingWorker(worker, request.request_id)
    request.new_workers = [*request.new_workers, *taken, *fresh]
    ready = all(state.pending_workers[worker].status == READY for worker in request.new_workers)
    request.all_reported_at = now if ready else None  # nothing to start: standbys, or no new worker at all
    pool.refill(state)
    return taken + fresh


def register(state: JobState, request: RegisterRequest, now: float | None = None) -> RegisterReply:
    """Record a worker's host/device/pid (and topology); for a joiner this is *report ready*. A member learns whether
    new workers are coming (``joiners_coming``): then it prepares to serve them from its first step on."""
    worker_id = request.worker_id
    where = (request.host, request.device, request.pid, _checked_topology(worker_id, request.topology))
    member = state.member(worker_id)
    if member is not None:
        member.host, member.device, member.pid, member.topology = where
        return RegisterReply(joiners_coming=True if joiners_coming(state) else None)
    pending = state.pending_workers.get(worker_id)
    if pending is None:
        if worker_id in state.left_workers:
            raise StateError(f"worker {worker_id} has left the job")
        raise StateError(f"unknown worker {worker_id}")
    pending.host, pending.device, pending.pid, pending.topology = where
    if pending.status in (REQUESTED, SPAWNED):
        pending.status = READY
        pending.ready_at = now_or_clock(now)
        _note_ready(state, pending.request_id, pending.ready_at)
    return RegisterReply()


def joiners_coming(state: JobState) -> bool:
    """A queued request starts new workers: the members may prepare to serve them while they warm up."""
    return not state.finished and any(request.new_workers for request in state.pending)


def spawn_requested(state: JobState, now: float) -> list[SpawnOrder]:
    """The requested workers the launcher has to start now (marked spawned)."""
    spawn = []
    for pending in state.pending_workers.values():
        if pending.status == REQUESTED:
            pending.status = SPAWNED
            pending.spawned_at = now
            spawn.append(SpawnOrder(pending.worker_id, pending.request_id))
    return spawn


def fail_unreported(state: JobState, now: float) -> list[str]:
    """Fail every request with a worker started more than ``report_timeout_s`` ago that never reported; returns the
    workers to stop (late standbys included)."""
    stop = pool.drop_unreported(state, now)
    for request in list(state.pending):
        late = [
            worker for worker in request.new_workers
            if (pending := state.pending_workers.get(worker)) is not None and pending.status == SPAWNED
            and pending.spawned_at is not None and now - pending.spawned_at > state.report_timeout_s
        ]
        if late:
            reason = f"{named(late)} did not report ready within {state.report_timeout_s:.0f} s"
            fail_request(state, request, reason)
            stop += [worker for worker in request.new_workers if worker in state.pending_workers]
    return stop


def pending_worker_exited(state: JobState, pending: PendingWorker, returncode: int) -> bool:
    """Handle the exit of a joiner that is not a member yet; returns whether the exit was expected."""
    if pending.status == CANCELLED:
        del state.pending_workers[pending.worker_id]
        return returncode == 0
    if pool.exited(state, pending.worker_id, returncode):
        return False
    request = state.pending_request(pending.request_id)
    if request is None:  # its plan is decided: the adjustment will fail in the workers
        logger.error(
            "joiner %s of the decided request %s exited with code %s",
            pending.worker_id,
            pending.request_id,
            returncode,
        )
        state.record_failure(adjustment_failure(
            _adjustment_of(state, pending.request_id), pending.request_id,
            f"joiner {pending.worker_id} exited with code {returncode} after its plan was decided",
        ))
        return False
    reason = f"worker {pending.worker_id} exited with code {returncode} before its plan was decided"
    fail_request(state, request, reason)
    del state.pending_workers[pending.worker_id]
    return False


def fail_request(state: JobState, request: ScaleRequest, reason: str) -> None:
    """Drop a pending request, cancel its new workers and keep the failure for status."""
    logger.warning("request %s (%s) failed: %s", request.request_id, request.action, reason)
    state.pending.remove(request)
    cancel_workers(state, request, f"request {request.request_id} failed: {reason}")
    state.record_failure(request_failure(request, "failed", reason))


def cancel_workers(state: JobState, request: ScaleRequest, reason: str) -> None:
    """Cancel the request's new workers that are still waiting (their ``wait_plan`` answers ``cancelled``)."""
    for worker in request.new_workers:
        pending = state.pending_workers.get(worker)
        if pending is not None and pending.status in WAITING_STATUSES:
            pending.status = CANCELLED
            pending.reason = reason


def shutdown(state: JobState, reason: str | None = None) -> EmptyReply:
    """Cancel the pending requests and the standby pool and mark the job finished (idempotent)."""
    if state.finished:
        return EmptyReply()
    reason = reason or "shutdown"
    for request in state.pending:
        cancel_workers(state, request, f"job shut down: {reason}")
        state.record_failure(request_failure(request, "cancelled", f"job shut down: {reason}"))
    state.pending = []
    pool.cancel_pool(state, f"job shut down: {reason}")
    state.finished = True
    state.finish_reason = reason
    return EmptyReply()


def request_failure(request: ScaleRequest, outcome: str, reason: str) -> dict[str, Any]:
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


def _note_ready(state: JobState, request_id: str, ready_at: float) -> None:
    request = state.pending_request(request_id)
    if request is None:
        return
    if all(state.pending_workers[worker].status == READY for worker in request.new_workers):
        request.all_reported_at = ready_at


def _adjustment_of(state: JobState, request_id: str) -> Adjustment | None:
    """The decided adjustment of ``request_id`` (in flight or still completing), if any."""
    candidates = [state.in_flight, *state.completing]
    return next((a for a in candidates if a is not None and a.plan.request_id == request_id), None)


def _checked_topology(worker_id: str, topology: Any) -> dict[str, Any] | None:
    """A registered topology as a plain dict, or None (logged) when it is not one the planner can read."""
    if topology is None:
        return None
    try:
        return WorkerTopology.coerce(topology).to_dict()
    except (TypeError, ValueError, AttributeError) as error:
        logger.warning("worker %s registered an unreadable topology (%s): ignored", worker_id, error)
        return None


# ---- validation: a scale request against the projected world ------------------------------------------------------


def _resolve_request(
    state: JobState, action: str, count: int | None, ranks: list[int] | None, size: int | None, at_step: int | None
) -> ScaleRequest:
    """Validate a scale request against the projected world and turn it into adds and removals."""
    if action not in ACTIONS:
        raise StateError(f"unknown action {action!r} (expected add, remove, migrate or to)")
    _check_arguments(action, count, ranks, size)
    if at_step is not None and at_step < 0:
        raise StateError(f"at_step must be ≥ 0, got {at_step}")
    request = ScaleRequest(request_id="", action=action, count=count, size=size, at_step=at_step)
    projected = state.projected_size()
    if action == "add":
        request.add_count = _positive_count(action, count)
    elif action == "remove" and ranks is not None:
        request.ranks = _checked_ranks(state, ranks, projected)
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


def _checked_ranks(state: JobState, ranks: list[int], projected: int) -> list[int]:
    if not ranks:
        raise StateError("ranks must not be empty")
    generation = state.generation + len(state.pending)
    for rank in ranks:
        if not 0 <= rank < projected:
            raise StateError(f"rank {rank} does not exist in generation {generation} (world size {projected})")
    if len(set(ranks)) != len(ranks):
        raise StateError(f"ranks must be distinct, got {ranks}")
    if len(ranks) >= projected:
        raise StateError(f"cannot remove all {projected} workers")
    return sorted(ranks)


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
        raise StateError(cannot_remove_all(projected))
    if count > projected:
        raise StateError(f"cannot remove {plural(count, 'worker')}: the job has only {projected}")
    return count


def cannot_remove_all(count: int) -> str:
    """``cannot remove all 3 workers`` / ``cannot remove the only worker``."""
    return f"cannot remove all {count} workers" if count != 1 else "cannot remove the only worker"


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
