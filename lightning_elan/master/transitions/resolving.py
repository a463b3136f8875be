"""The head request resolved again when it is decided: the members it applies to may not be those it was queued
against (a member died or left, a request before it failed), so ``to N`` leaves exactly N workers (it takes in the
replacements queued behind it, cancels the joiners it no longer needs, starts those it lacks, or has nothing to do),
``migrate K`` moves at most the members there are, and ``remove K`` that would remove every member fails with the
reason. Semantics: docs/architecture.md, *Semantics of the AM*."""

from __future__ import annotations

import logging

from lightning_elan.master.narration import plural, workers_phrase
from lightning_elan.master.state import CANCELLED, READY, REQUESTED, SPAWNED, JobState, ScaleRequest, StateError
from lightning_elan.master.transitions import requests
from lightning_elan.protocol.contract import worker_number

logger = logging.getLogger(__name__)

__all__ = ["SKIPPED", "resolve"]

SKIPPED = "skipped"  # the outcome (in ``failures``) of a ``to N`` that found the job at N workers: nothing to do
_READINESS = {READY: 2, SPAWNED: 1, REQUESTED: 0}  # higher: kept first


def resolve(state: JobState, request: ScaleRequest, now: float) -> bool:
    """Fit the head ``request`` to the current members; False: it had nothing left to do and left the queue (kept in
    ``failures`` as ``skipped``). ``StateError``: it cannot apply (the caller fails it)."""
    if request.action == "to":
        return _resolve_to(state, request, now)
    if request.action == "migrate":
        _resolve_migrate(state, request)
    elif request.action == "remove" and request.ranks is None:
        _check_remove(state, request)
    return True


# ---- to N ------------------------------------------------------------------------------------------------------------


def _resolve_to(state: JobState, request: ScaleRequest, now: float) -> bool:
    """``to N`` against the members now: add ``N - members`` (its joiners, then the replacements behind it, then new
    ones) or remove ``members - N`` newest members; none of either: skipped."""
    size, current = request.size or 0, state.world_size
    before = (request.add_count, request.remove_count)
    _take_replacements(state, request)
    wanted = max(0, size - current)
    request.remove_count = max(0, current - size)
    have = len(request.new_workers)
    dropped = _drop_joiners(state, request, have - wanted, f"the job has {plural(current, 'worker')} when "
                            f"request {request.request_id} (to {size}) applies") if have > wanted else []
    started = _top_up(state, request, wanted - have, now) if have < wanted else []
    request.add_count = len(request.new_workers)
    _note_readiness(state, request, now)
    if not request.add_count and not request.remove_count:
        _skip(state, request, _nothing_to_do(state, size, current), now)
        return False
    if (request.add_count, request.remove_count) != before or dropped or started:
        logger.warning("job %r: request %s (to %d) is resolved against the %s of generation %d: %s (queued as: %s%s)",
                       state.job, request.request_id, size, plural(current, "member"), state.generation,
                       _counts(request.add_count, request.remove_count), _counts(*before),
                       _changed_joiners(started, dropped))
    return True


def _take_replacements(state: JobState, request: ScaleRequest) -> None:
    """The replacements of dead members queued behind a ``to N`` become its joiners: the size it leaves already
    counts those deaths (without this the job would end at N plus one per death)."""
    for replacement in [r for r in state.pending[1:] if r.replaces is not None]:
        state.pending.remove(replacement)
        for worker in replacement.new_workers:
            state.pending_workers[worker].request_id = request.request_id
        request.new_workers = [*request.new_workers, *replacement.new_workers]
        logger.info("job %r: the replacement of %s (%s) is part of request %s (to %s) now", state.job,
                    replacement.replaces, replacement.request_id, request.request_id, request.size)


def _top_up(state: JobState, request: ScaleRequest, count: int, now: float) -> list[str]:
    """Start the ``count`` joiners ``to N`` lacks (the decision waits until they are ready, as for any request);
    a job of `elan worker`s cannot: it resizes with the workers it has."""
    if state.enrolment is not None:
        logger.warning("job %r: request %s (to %s) lacks %s, and the job's workers are started by their scheduler: "
                       "it resizes with the workers it has; start %d more `elan worker --job %s` to grow it",
                       state.job, request.request_id, request.size, plural(count, "worker"), count, state.job)
        return []
    return requests.start_workers(state, request, count, now)


def _nothing_to_do(state: JobState, size: int, current: int) -> str:
    if size == current:
        return f"the job already has {plural(current, 'worker')}: nothing to do"
    return (f"the job has {plural(current, 'worker')} and its workers are started by their scheduler: start "
            f"{size - current} more `elan worker --job {state.job}` to grow it")


def _skip(state: JobState, request: ScaleRequest, reason: str, now: float) -> None:
    """The request leaves the queue without an adjustment (its new workers, if any, are cancelled)."""
    logger.info("job %r: request %s (to %s) at step %s: %s", state.job, request.request_id, request.size,
                state.progress.step, reason)
    state.pending.remove(request)
    requests.cancel_workers(state, request, f"request {request.request_id} had nothing to do: {reason}")
    state.record_failure(requests.request_failure(request, SKIPPED, reason), now)


# ---- migrate K, remove K ---------------------------------------------------------------------------------------------


def _resolve_migrate(state: JobState, request: ScaleRequest) -> None:
    """``migrate K`` with fewer than K members now migrates them all (the joiners it no longer needs are
    cancelled)."""
    current = state.world_size
    if request.remove_count <= current:
        return
    dropped = _drop_joiners(state, request, request.remove_count - current,
                            f"the job has {plural(current, 'worker')} when request {request.request_id} (migrate "
                            f"{request.count}) applies")
    logger.warning("job %r: request %s (migrate %s) is resolved against the %s of generation %d: it migrates %s "
                   "(%s)", state.job, request.request_id, request.count, plural(current, "member"), state.generation,
                   "them all" if current > 1 else "it", _changed_joiners([], dropped).removeprefix("; "))
    request.remove_count = request.add_count = current


def _check_remove(state: JobState, request: ScaleRequest) -> None:
    """``remove K`` may not remove every member: with K or fewer members now, it fails."""
    current = state.world_size
    if request.remove_count >= current:
        raise StateError(f"cannot remove {plural(request.remove_count, 'worker')}: the job has only {current} now "
                         "(fewer than when the request was queued), and it keeps at least one worker")


# ---- the request's joiners -------------------------------------------------------------------------------------------


def _drop_joiners(state: JobState, request: ScaleRequest, count: int, reason: str) -> list[str]:
    """Take ``count`` joiners off the request, the least ready first (highest number among equals): a joiner not
    started yet is forgotten, a started one cancelled (its ``wait_plan`` answers ``cancelled``; it exits 0)."""
    ranked = sorted(request.new_workers, key=lambda worker: (-_READINESS.get(state.pending_workers[worker].status, -1),
                                                              worker_number(worker)))
    dropped = ranked[len(ranked) - count:]
    request.new_workers = [worker for worker in request.new_workers if worker not in dropped]
    for worker in dropped:
        pending = state.pending_workers[worker]
        if pending.status == REQUESTED:
            del state.pending_workers[worker]
        else:
            pending.status, pending.reason = CANCELLED, f"not needed: {reason}"
    return dropped


def _note_readiness(state: JobState, request: ScaleRequest, now: float) -> None:
    """``all_reported_at``: when the last of the request's (current) new workers reported ready; None until then."""
    pending = [state.pending_workers[worker] for worker in request.new_workers]
    if any(worker.status != READY for worker in pending):
        request.all_reported_at = None
    elif request.all_reported_at is None:
        request.all_reported_at = max((worker.ready_at or now for worker in pending), default=now)


def _counts(add: int, remove: int) -> str:
    """``add 2 workers`` / ``remove 1 worker`` / ``add 1 worker and remove 1 worker``."""
    parts = [f"add {plural(add, 'worker')}" if add else "", f"remove {plural(remove, 'worker')}" if remove else ""]
    return " and ".join(part for part in parts if part) or "change nothing"


def _changed_joiners(started: list[str], dropped: list[str]) -> str:
    """``; starts w5`` / ``; cancels w4`` (after the rest of a parenthesis), or nothing."""
    parts = ([f"starts {workers_phrase(started)}"] if started else []) + \
            ([f"cancels {workers_phrase(dropped)}"] if dropped else [])
    return "".join(f"; {part}" for part in parts)
