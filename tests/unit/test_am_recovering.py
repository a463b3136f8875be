"""Recovery (``master/transitions/recovering.py``): worker exits, survivors checking in, the plan, a failed job."""

from __future__ import annotations

import pytest

from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import adjustments, recovering
from lightning_elan.protocol.contract import ACTION_FAILURE, RecoverRequest, WaitPlanReply, WorkerExitReply
from tests.unit.am_steps import exited, ready, started


def check_in(state: JobState, worker: str, step: int = 7, now: float | None = None) -> dict:
    return recovering.recover(state, RecoverRequest(worker_id=worker, generation=0, step=step, has_state=True),
                              now=now)


def test_a_dead_member_fails_its_generation_and_the_survivors_form_the_plan() -> None:
    state = started(3)

    reply = exited(state, "w1", 9)
    assert reply == WorkerExitReply(False, recovering=True, failed_generations=[0])
    assert state.recovery is not None and state.recovery.survivors == ["w0", "w2"]
    assert check_in(state, "w0", now=5.0) == WaitPlanReply.wait()
    check_in(state, "w2", now=6.0)

    plan = state.in_flight.plan
    assert state.recovery is None and (plan.action, plan.members, plan.step) == (ACTION_FAILURE, ["w0", "w2"], 7)
    assert state.left_workers == ["w1"] and state.member_ids == ["w0", "w1", "w2"]  # until the plan commits
    assert adjustments.wait_plan(state, "w2").plan == plan


def test_when_every_member_dies_the_job_fails() -> None:
    state = started(2)
    exited(state, "w0", 1)

    assert exited(state, "w1", 1) == WorkerExitReply(False, recovering=False)
    assert state.finished and state.failed_reason == "every worker of generation 0 died"
    assert state.failures[-1]["kind"] == "job"


def test_a_survivor_that_never_checks_in_is_declared_dead() -> None:
    state = started(3)
    ready(state, "w0", "w1", "w2")
    exited(state, "w2", 1)
    check_in(state, "w0")
    deadline = state.recovery.deadline

    assert recovering.declare_silent_survivors_dead(state, deadline - 1) == []
    assert recovering.declare_silent_survivors_dead(state, deadline) == ["w1"]
    assert state.recovery is None and state.in_flight.plan.members == ["w0"]


def test_a_survivor_still_starting_has_the_start_up_allowance_not_the_recoverys_deadline() -> None:
    """w2 dies while w1 still imports its framework (it never registered): at the recovery's deadline w1 is not
    hung but starting; it is declared dead only after ``join_timeout_s``, and checks in before that as it starts."""
    state = started(3)
    ready(state, "w0")
    exited(state, "w2", -9)
    check_in(state, "w0")
    recovery = state.recovery
    starting_until = recovery.detected_at + state.join_timeout_s
    assert recovery.deadline < starting_until

    assert recovering.declare_silent_survivors_dead(state, recovery.deadline) == []
    assert recovering.declare_silent_survivors_dead(state, starting_until - 1) == []
    check_in(state, "w1")
    assert state.recovery is None and state.in_flight.plan.members == ["w0", "w1"]


def test_a_survivor_that_never_starts_is_declared_dead_after_the_start_up_allowance() -> None:
    state = started(3)
    ready(state, "w0")
    exited(state, "w2", -9)
    check_in(state, "w0")
    starting_until = state.recovery.detected_at + state.join_timeout_s

    assert recovering.declare_silent_survivors_dead(state, starting_until) == ["w1"]
    assert state.recovery is None and state.in_flight.plan.members == ["w0"]


def test_clean_exits_are_expected_only_where_they_mean_nothing_went_wrong() -> None:
    state = started(2)

    assert exited(state, "w0", 0) == WorkerExitReply(False)  # fit returned on a member: trained out
    assert state.trained_out == ["w0"] and state.training_over()
    assert exited(state, "w1", 1) == WorkerExitReply(True)  # after the training completed
    with pytest.raises(StateError, match=r"^unknown worker w9$"):
        exited(state, "w9", 0)


def test_the_failure_policy_is_validated() -> None:
    state = started(1)

    with pytest.raises(StateError, match="min_workers must be ≥ 1"):
        recovering.set_failure_policy(state, True, 0, None)
    recovering.set_failure_policy(state, True, 2, 5.0)
    assert (state.replace_failed, state.min_workers, state.join_timeout_s) == (True, 2, 5.0)
