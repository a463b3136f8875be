"""Workers started by a scheduler (``elan worker``): every transition of a job whose workers enrol — the AM lets them
enrol, generation 0 forms from those waiting (``master/enrolment.py`` decides when), a later one joins by an ``add``
of its own, and the AM's own clock (``housekeeping``) drives what ``elan run``'s launcher would."""

from __future__ import annotations

import logging

from lightning_elan.master.enrolment import Enrollee, Enrolment
from lightning_elan.master.narration import plural, workers_phrase
from lightning_elan.master.state import SPAWNED, JobState, Member, StateError, now_or_clock
from lightning_elan.master.transitions import adjustments, finishing, recovering, requests
from lightning_elan.protocol.contract import (
    DEFAULT_COORDINATE_EVERY,
    ROLE_WAITING,
    EnrolReply,
    EnrolRequest,
)

logger = logging.getLogger(__name__)

__all__ = ["accept_enrolments", "enrol", "housekeeping"]


def accept_enrolments(state: JobState, enrolment: Enrolment, coordinate_every: int | None = None,
                      report_timeout_s: float | None = None, join_timeout_s: float | None = None) -> None:
    """Let workers enrol (``elan am --min-workers``); the job starts from the first ``enrolment.max_workers``."""
    if state.started or state.enrolment is not None:
        return  # a resumed AM keeps what its state says
    state.enrolment = enrolment
    state.coordinate_every = coordinate_every
    if report_timeout_s is not None:
        state.report_timeout_s = float(report_timeout_s)
    recovering.set_failure_policy(state, False, enrolment.min_workers, join_timeout_s)


def enrol(state: JobState, request: EnrolRequest, now: float | None = None) -> EnrolReply:
    """A new worker gets an id (a place in generation 0, or a joiner's add request); a known one polls."""
    if state.enrolment is None:
        raise StateError(f"job {state.job} does not take `elan worker`s: its workers are started by `elan run` "
                         "(start its AM with `elan am --min-workers N` for workers started by a scheduler)")
    if state.finished:
        raise StateError(f"job {state.job} has finished ({state.finish_reason})")
    if request.worker_id is not None:
        return _enrolment_of(state, request.worker_id, now_or_clock(now))
    if state.started:
        return _enrol_joiner(state, request, now_or_clock(now))
    if state.enrolment.is_full():
        raise StateError(f"job {state.job} has its {plural(state.enrolment.max_workers, 'worker')} (--max-workers)")
    worker_id = state.new_worker_ids(1)[0]
    state.enrolment.enrol(worker_id, request.host, request.pid, now_or_clock(now))
    logger.info("job %s: %s enrolled from %s (%d waiting, the job starts at %d)", state.job, worker_id,
                request.host, len(state.enrolment.waiting), state.enrolment.min_workers)
    housekeeping(state, now_or_clock(now))
    return _enrolment_of(state, worker_id, now_or_clock(now))


def housekeeping(state: JobState, now: float | None = None) -> list[str]:
    """The AM's own clock for a job of enrolled workers (``elan run``'s launcher drives it otherwise): start the
    job, fail joiners that never report, declare silent survivors dead, finish once every member trained out
    (``finishing``). Returns the workers declared dead."""
    now = now_or_clock(now)
    if state.enrolment is None or state.finished:
        return []
    if not state.started:
        _start_if_enrolled(state, now)
        return []
    dead = requests.fail_unreported(state, now) + recovering.declare_silent_survivors_dead(state, now)
    recovering.form_plan_if_ready(state, now)
    finishing.finish_if_done(state)
    return dead


def _enrol_joiner(state: JobState, request: EnrolRequest, now: float) -> EnrolReply:
    assert state.enrolment is not None
    if state.projected_size() >= state.enrolment.max_workers:
        raise StateError(f"job {state.job} has its {plural(state.enrolment.max_workers, 'worker')} (--max-workers): "
                         "this worker is not needed")
    if state.training_over():
        raise StateError(f"job {state.job} has finished training (a member of generation {state.generation} "
                         "completed it): this worker is not needed")
    queued = requests.queue_add(state, now)
    worker_id = queued.new_workers[0]
    pending = state.pending_workers[worker_id]
    pending.status, pending.spawned_at, pending.host, pending.pid = SPAWNED, now, request.host, request.pid
    logger.info("job %s: %s enrolled from %s as a joiner (request %s)", state.job, worker_id, request.host,
                queued.request_id)
    return _enrolment_of(state, worker_id, now)


def _enrolment_of(state: JobState, worker_id: str, now: float) -> EnrolReply:
    member = state.member(worker_id)
    if member is not None:
        return EnrolReply(worker_id, "member", state.generation, state.member_ids.index(worker_id), state.world_size,
                          state.coordinate_every or DEFAULT_COORDINATE_EVERY)
    if worker_id in state.pending_workers:
        return EnrolReply(worker_id, "joiner", coordinate_every=state.coordinate_every or DEFAULT_COORDINATE_EVERY,
                          launch_world_size=state.launch_world_size)
    if state.enrolment is not None and state.enrolment.seen(worker_id, now):
        return EnrolReply(worker_id, ROLE_WAITING)
    if worker_id in state.left_workers:
        raise StateError(f"worker {worker_id} has left job {state.job}")
    raise StateError(f"worker {worker_id} is not enrolled in job {state.job} (dropped after "
                     f"{state.enrolment.silence_s if state.enrolment else 0:.0f} s without a poll?): enrol again")


def _start_if_enrolled(state: JobState, now: float) -> None:
    assert state.enrolment is not None
    for worker in state.enrolment.drop_silent(now):
        logger.warning("job %s: %s stopped polling before the start: dropped", state.job, worker)
    enrollees = state.enrolment.starting_members(now)
    if enrollees is None:
        return
    adjustments.form_generation_zero(state, [_member_of(enrollee) for enrollee in enrollees])
    state.enrolment.waiting = []
    state.started = True
    logger.info("job %s starts with %s: %s", state.job, plural(len(state.members), "enrolled worker"),
                workers_phrase(state.member_ids))


def _member_of(enrollee: Enrollee) -> Member:
    return Member(enrollee.worker_id, 0, host=enrollee.host, pid=enrollee.pid)
