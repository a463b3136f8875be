"""The head request resolved again when it is decided (``master/transitions/resolving.py``): the members changed
since it was queued (a death, a replacement), and ``to N`` still leaves N workers, ``remove K`` never removes every
member, ``migrate K`` moves at most the members there are."""

from __future__ import annotations

import pytest

from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.state import CANCELLED, READY, JobState
from lightning_elan.master.transitions import adjustments, enrolling, leaving, recovering, requests
from lightning_elan.protocol.contract import (
    ACTION_FAILURE,
    STATUS_CANCELLED,
    CoordinateReply,
    CoordinateRequest,
    EnrolRequest,
    RecoverRequest,
)
from tests.unit.am_steps import commit, exited, ready, started

AT_STEP = 28


def recovered(state: JobState, dead: str, step: int = 10) -> None:
    """``dead`` is SIGKILLed; the survivors check in and the recovery plan commits (before ``AT_STEP``)."""
    exited(state, dead, -9)
    for survivor in list(state.recovery.survivors):
        check_in = RecoverRequest(survivor, state.generation, has_state=True, step=step)
        recovering.recover(state, check_in, now=float(step))
    plan = state.in_flight.plan
    assert plan.action == ACTION_FAILURE
    commit(state, plan, step + 1)
    assert state.in_flight is None and dead not in state.member_ids


def coordinate(state: JobState, step: int = AT_STEP) -> CoordinateReply:
    """Rank 0 coordinates at ``step``."""
    return adjustments.coordinate(state, CoordinateRequest(state.member_ids[0], state.generation, step), now=100.0)


def test_to_n_after_a_death_that_already_left_n_workers_changes_nothing() -> None:
    """The probe's case: ``elan run --nproc 3 --schedule 28:to=2`` and a member SIGKILLed before step 28 (before:
    ``to 2`` was applied as the ``remove 1`` it was queued as, and the job ended at 1 worker)."""
    state = started(3)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    recovered(state, "w1")

    reply = coordinate(state)

    assert reply.plan is None and state.in_flight is None and state.pending == []
    assert state.member_ids == ["w0", "w2"]
    failure = state.failures[-1]
    assert (failure["kind"], failure["outcome"], failure["request_id"]) == ("request", "skipped", "r1")
    assert failure["reason"] == "the job already has 2 workers: nothing to do"


def test_to_n_after_a_death_removes_only_what_is_above_n() -> None:
    state = started(4)
    requests.scale(state, "to", size=2, at_step=AT_STEP)  # queued as remove 2
    recovered(state, "w0")

    plan = coordinate(state).plan

    assert plan is not None and plan.action == "to"
    assert (plan.previous_members, plan.members, plan.leavers) == (["w1", "w2", "w3"], ["w1", "w2"], ["w3"])


def test_to_n_that_lacks_joiners_after_a_death_starts_them_and_waits_for_them() -> None:
    state = started(2)
    requests.scale(state, "to", size=3, at_step=AT_STEP)  # queued as add 1: w2
    requests.spawn_requested(state, now=1.0)
    ready(state, "w2")
    recovered(state, "w1")

    assert coordinate(state).plan is None  # w3 started for it: the decision waits until it is ready
    assert state.pending[0].new_workers == ["w2", "w3"] and state.pending[0].add_count == 2
    assert [order.worker_id for order in requests.spawn_requested(state, now=2.0)] == ["w3"]
    assert coordinate(state, AT_STEP + 1).plan is None
    ready(state, "w3")

    plan = coordinate(state, AT_STEP + 2).plan

    assert plan is not None and (plan.members, plan.joiners, plan.leavers) == (["w0", "w2", "w3"], ["w2", "w3"], [])


def test_to_n_takes_in_the_replacements_queued_behind_it() -> None:
    """``to 4`` queued at 3 (w3 starting); a member dies and its ``--replace-failed`` replacement is queued behind
    it: ``to 4`` takes it in, needs both joiners, and decides once they are ready."""
    state = started(3, replace_failed=True)
    requests.scale(state, "to", size=4, at_step=AT_STEP)
    recovered(state, "w1")
    queued = [(r.action, r.replaces, r.new_workers) for r in state.pending]
    assert queued == [("to", None, ["w3"]), ("add", "w1", ["w4"])]
    requests.spawn_requested(state, now=1.0)
    ready(state, "w3", "w4")

    plan = coordinate(state).plan

    assert plan is not None and (plan.members, plan.joiners) == (["w0", "w2", "w3", "w4"], ["w3", "w4"])
    assert state.pending == []  # the replacement is part of the resize: the job ends at 4, not 5


def test_to_n_with_replace_failed_cancels_a_replacement_the_size_does_not_need() -> None:
    state = started(3, replace_failed=True)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    recovered(state, "w1")
    requests.spawn_requested(state, now=1.0)  # the replacement w3 is started

    assert coordinate(state).plan is None
    assert state.pending == [] and state.member_ids == ["w0", "w2"]  # the job ends at 2, not 3
    assert state.pending_workers["w3"].status == CANCELLED
    answer = adjustments.wait_plan(state, "w3")
    assert answer.status == STATUS_CANCELLED and answer.reason.startswith("not needed: the job has 2 workers")


def test_a_joiner_of_to_n_that_is_no_longer_needed_is_forgotten_if_never_started() -> None:
    state = started(3, replace_failed=True)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    recovered(state, "w1")  # its replacement w3 is queued, not started yet

    coordinate(state)

    assert "w3" not in state.pending_workers and requests.spawn_requested(state, now=1.0) == []


def test_a_recovery_that_takes_the_joiner_of_to_n_leaves_the_resize_queued() -> None:
    """Below ``--min-workers`` the recovery takes a ready joiner of ``to 4``; the resize stays queued and starts the
    joiner it then lacks (before: the request left the queue with its joiner, and the job stayed at 3)."""
    state = started(3, min_workers=3, join_timeout_s=60.0)
    requests.scale(state, "to", size=4, at_step=AT_STEP)
    requests.spawn_requested(state, now=1.0)
    ready(state, "w3")
    recovered(state, "w1")
    assert state.member_ids == ["w0", "w2", "w3"] and state.pending[0].new_workers == []

    assert coordinate(state).plan is None and state.pending[0].new_workers == ["w4"]
    requests.spawn_requested(state, now=2.0)
    ready(state, "w4")

    plan = coordinate(state, AT_STEP + 1).plan

    assert plan is not None and (plan.members, plan.joiners) == (["w0", "w2", "w3", "w4"], ["w4"])


def test_to_n_after_a_leave_ahead_of_it_changes_nothing() -> None:
    """A member's SIGTERM (``leave``, queued at the head) shrinks the job to N before ``to N`` applies."""
    state = started(3)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    leaving.request_leave(state, "w0")
    commit(state, coordinate(state, 5).plan, 6)

    assert coordinate(state).plan is None and state.member_ids == ["w1", "w2"] and state.pending == []
    assert state.failures[-1]["outcome"] == "skipped"


def test_the_projected_size_counts_to_n_as_n() -> None:
    state = started(3)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    recovered(state, "w1")

    assert state.projected_size() == 2
    requests.scale(state, "remove", count=1, at_step=AT_STEP)  # before: refused, "cannot remove the only worker"
    assert state.projected_size() == 1


@pytest.mark.parametrize("count", [2, 3])
def test_remove_k_that_would_remove_every_member_after_a_death_fails_and_says_why(count: int) -> None:
    state = started(4)
    requests.scale(state, "remove", count=count, at_step=AT_STEP)
    recovered(state, "w1")
    recovered(state, "w2")

    assert coordinate(state).plan is None
    assert state.pending == [] and state.member_ids == ["w0", "w3"]
    failure = state.failures[-1]
    assert (failure["kind"], failure["outcome"]) == ("request", "failed")
    assert failure["reason"] == (f"cannot remove {count} workers: the job has only 2 now (fewer than when the request "
                                 "was queued), and it keeps at least one worker")


def test_remove_k_after_a_death_removes_k_of_the_members_left() -> None:
    state = started(3)
    requests.scale(state, "remove", count=1, at_step=AT_STEP)
    recovered(state, "w0")

    plan = coordinate(state).plan

    assert plan is not None and (plan.members, plan.leavers) == (["w1"], ["w2"])


def test_migrate_k_with_fewer_members_left_migrates_them_all() -> None:
    state = started(3)
    requests.scale(state, "migrate", count=3, at_step=AT_STEP)
    requests.spawn_requested(state, now=1.0)
    ready(state, "w3", "w5")  # w4 is the least ready: it is the one cancelled
    recovered(state, "w1")

    plan = coordinate(state).plan

    assert plan is not None and (plan.members, plan.leavers, plan.joiners) == (["w3", "w5"], ["w0", "w2"],
                                                                                ["w3", "w5"])
    assert state.pending_workers["w4"].status == CANCELLED


def test_migrate_k_after_a_death_with_enough_members_is_unchanged() -> None:
    state = started(3)
    requests.scale(state, "migrate", count=1, at_step=AT_STEP)
    requests.spawn_requested(state, now=1.0)
    ready(state, "w3")
    recovered(state, "w0")

    plan = coordinate(state).plan

    assert plan is not None and (plan.members, plan.leavers, plan.joiners) == (["w1", "w3"], ["w2"], ["w3"])


def test_to_n_of_a_job_of_elan_workers_resizes_with_the_workers_it_has() -> None:
    """A job of `elan worker`s: the AM cannot start the joiners ``to 3`` lacks after a death: it resizes with those it
    has (here: nothing to do), and says to start more `elan worker`s."""
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(1, 3, start_grace_s=5.0), coordinate_every=1)
    for host in ("a", "b", "c"):
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)
    enrolling.housekeeping(state, now=5.0)
    requests.scale(state, "to", size=2, at_step=AT_STEP)
    recovered(state, "w1")
    recovered(state, "w2")

    reply = coordinate(state)

    assert reply.plan is None and state.member_ids == ["w0"] and state.pending == []
    assert state.failures[-1]["reason"] == ("the job has 1 worker and its workers are started by their scheduler: "
                                            "start 1 more `elan worker --job job` to grow it")


def test_a_resolved_request_survives_the_persisted_form() -> None:
    state = started(2, replace_failed=True)
    requests.scale(state, "to", size=3, at_step=AT_STEP)
    recovered(state, "w1")

    copy = JobState.from_dict(state.to_dict())

    assert [r.replaces for r in copy.pending] == [None, "w1"]
    assert coordinate(copy).plan is None and copy.pending[0].new_workers == ["w2", "w3"]
    assert all(copy.pending_workers[w].status != READY for w in copy.pending[0].new_workers)
