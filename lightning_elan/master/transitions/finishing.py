"""Whether the job is done: the one place that decides it, and finishes the job (``requests.shutdown``) when it is.

A job of ``elan run`` is done once its launcher has reported (``worker_exit``) every member of the current generation
exited having finished training — with what the rendezvous store said of each (``WorkerExit``) — unless they left for
the plan in flight; a job of ``elan worker``s by the same rule (each ``elan worker`` reports its command's exit and
marks), outside any adjustment. The launcher only
obeys: it sees ``finished`` and the reason in the replies and in ``status``. Semantics: docs/architecture.md,
*Worker failures*.
"""

from __future__ import annotations

import logging

from lightning_elan.master.state import JobState, WorkerExit
from lightning_elan.master.transitions import requests
from lightning_elan.protocol.contract import FINISHED_BY_AM, FINISHED_BY_LAUNCHER, SIGTERM_EXITS

logger = logging.getLogger(__name__)

__all__ = ["finish_if_done"]


def finish_if_done(state: JobState) -> bool:
    """Finish a started job whose training is complete (idempotent); True if it finished now."""
    if not state.started or state.finished:
        return False
    if state.enrolment is not None:
        done, reason = _trained_out(state), FINISHED_BY_AM
    else:
        done, reason = _members_finished(state) and not _plan_carries_on(state), FINISHED_BY_LAUNCHER
    if done:
        logger.debug("job %s: every member of generation %d has finished: %s", state.job, state.generation, reason)
        requests.shutdown(state, reason)
    return done


def _trained_out(state: JobState) -> bool:
    """A job of ``elan worker``s: no plan is in flight and every member exited having finished training, by the
    rule of ``elan run``'s (a member killed after the last step, before the others exited, fails nothing)."""
    return state.in_flight is None and _members_finished(state)


def _members_finished(state: JobState) -> bool:
    """Every member of the current generation exited having finished training: exited 0; or stopped by SIGTERM once
    its training loop was over (nothing left to leave) while another member's exit 0 shows the training complete
    (every member trains every step, so the last step needed them all); or died while a member's training loop had
    ended (a death between the last step and its own mark) — unless a member's script ended in an uncaught exception
    (a crash after one is that failure: the job fails)."""
    exits = _members_exits(state)
    if exits is None:
        return False
    stopped = [how for how in exits if how.returncode != 0]
    if not stopped:
        return True
    if len(stopped) < len(exits) and all(how.returncode in SIGTERM_EXITS for how in stopped):
        return True
    return not any(e.script_failed for e in exits) and any(e.training_ended for e in exits)


def _members_exits(state: JobState) -> list[WorkerExit] | None:
    """How each member of the current generation exited; None while one of them runs (or there is none)."""
    exits = [state.exits[worker] for worker in state.member_ids if worker in state.exits]
    return exits if exits and len(exits) == len(state.members) else None


def _plan_carries_on(state: JobState) -> bool:
    """The members exited as the leavers of the plan in flight (a full migration): its joiners carry on. A plan one
    of whose stayers exited instead (having finished training, it never entered the plan's generation: rank 0 never
    learned of the plan) is stranded: the job is done without it, and the launcher stops its joiners."""
    if state.in_flight is None:
        return False
    plan = state.in_flight.plan
    if any(worker in plan.members for worker in state.member_ids):
        return False
    return any(state.exits[worker].left for worker in state.member_ids)
