"""A member that stops answering (``recovering.collective_stalled``): another member's collective timed out and no
member died. The generation fails as for a death; the silent member is declared dead after the reporter's wait and
killed by its launcher (``launcher_poll``'s ``kill``; an ``elan worker`` learns it from ``worker_poll``), and the plan
forms without it."""

from __future__ import annotations

import pytest

from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import launching, recovering, requests
from lightning_elan.protocol.contract import (
    ACTION_FAILURE,
    LauncherPollReply,
    RecoverRequest,
    StalledRequest,
    WorkerExitReply,
    WorkerPollReply,
    WorkerPollRequest,
)
from tests.unit.am_steps import decide, exited, ready, started


def stalled(state, worker: str, generation: int = 0, waited_s: float = 10.0, now: float = 100.0) -> WorkerExitReply:
    return recovering.collective_stalled(state, StalledRequest(worker, generation, waited_s, "gloo: Timed out"), now)


def check_in(state, worker: str, now: float) -> None:
    recovering.recover(state, RecoverRequest(worker_id=worker, generation=0, step=7, has_state=True), now=now)


def test_a_stall_fails_the_generation_and_the_silent_member_is_killed_after_the_wait() -> None:
    state = started(3)
    ready(state, "w0", "w1", "w2")

    assert stalled(state, "w0") == WorkerExitReply(False, recovering=True, failed_generations=[0])
    assert state.recovery.survivors == ["w0", "w1", "w2"] and state.recovery.deadline == 110.0
    assert state.failures[-1]["kind"] == "stall" and state.failures[-1]["worker_id"] == "w0"
    check_in(state, "w0", now=101.0)
    check_in(state, "w1", now=101.5)

    assert launching.launcher_poll(state, now=109.0) == LauncherPollReply([], [], False, [])
    poll = launching.launcher_poll(state, now=110.0)
    assert (poll.stop, poll.kill) == ([], ["w2"])
    plan = state.in_flight.plan
    assert (plan.action, plan.members, plan.step) == (ACTION_FAILURE, ["w0", "w1"], 7)


def test_every_member_that_times_out_gets_the_same_failure() -> None:
    state = started(3)
    ready(state, "w0", "w1", "w2")
    first = stalled(state, "w0", now=100.0)
    failure = state.recovery.failure_id

    assert stalled(state, "w1", now=103.0) == first
    assert state.recovery.failure_id == failure and state.recovery.deadline == 110.0
    assert [entry["kind"] for entry in state.failures] == ["stall"]


def test_a_stall_after_a_death_joins_the_deaths_recovery() -> None:
    """The member died without resetting its connections (its host lost power): the survivor's collective times out
    after the launcher reported the death; its report answers the recovery under way."""
    state = started(3)
    ready(state, "w0", "w1", "w2")
    exited(state, "w2", -9)

    assert stalled(state, "w0") == WorkerExitReply(False, recovering=True, failed_generations=[0])
    assert state.recovery.dead == ["w2"] and [entry["kind"] for entry in state.failures] == ["worker"]


@pytest.mark.parametrize(("worker", "generation", "waited_s", "message"), [
    ("w0", 1, 10.0, "generation 1 is not the current one"),
    ("w9", 0, 10.0, "unknown worker"),
    ("w0", 0, 0.0, "waited_s must be > 0"),
])
def test_a_stall_report_that_cannot_be_taken_is_refused(worker: str, generation: int, waited_s: float,
                                                        message: str) -> None:
    state = started(2)
    with pytest.raises(StateError, match=message):
        stalled(state, worker, generation, waited_s)
    assert state.recovery is None and state.failures == []


def test_a_late_stall_of_a_generation_whose_recovery_formed_answers_that_it_failed() -> None:
    """w1's collective timed out as the failure key reached it: its report comes after the recovery plan formed. It
    is told the generation failed (its check-in then gets the plan), and the plan in flight stands."""
    state = started(2)
    ready(state, "w0", "w1")
    stalled(state, "w0")
    check_in(state, "w0", now=101.0)
    check_in(state, "w1", now=101.0)
    plan = state.in_flight.plan

    assert stalled(state, "w1", now=102.0) == WorkerExitReply(False, recovering=True, failed_generations=[0])
    assert state.recovery is None and state.in_flight.plan == plan


def test_a_stall_as_a_plans_generation_forms_fails_the_plan_and_the_frozen_joiner_is_killed() -> None:
    """w2 joins (the plan to generation 1 is in flight) and freezes as the generation forms: the members' wait times
    out there. The plan fails with generation 0; the survivors are its members, w2 among them, and w2, silent, is
    declared dead and killed."""
    state = started(2)
    ready(state, "w0", "w1")
    joiner = requests.scale(state, "add", count=1).new_workers[0]
    launching.launcher_poll(state, now=99.0)
    ready(state, joiner)
    plan = decide(state)
    assert plan.generation == 1 and joiner in plan.members

    assert stalled(state, "w0", generation=1) == WorkerExitReply(False, recovering=True, failed_generations=[0, 1])
    assert state.in_flight is None and state.recovery.survivors == ["w0", "w1", joiner]
    for worker in ("w0", "w1"):
        check_in(state, worker, now=101.0)
    assert launching.launcher_poll(state, now=110.0).kill == [joiner]
    assert state.in_flight.plan.members == ["w0", "w1"]


def poll(state, worker: str) -> WorkerPollReply:
    return recovering.worker_poll(state, WorkerPollRequest(worker))


def test_worker_poll_tells_an_elan_worker_its_command_was_declared_dead_also_after_a_restart_of_the_am() -> None:
    """An ``elan worker`` has no ``launcher_poll``: it asks for its own command. The verdict outlives the recovery
    (the plan formed, the survivors trained on) and an AM's restart from its stored state."""
    state = started(3)
    ready(state, "w0", "w1", "w2")
    stalled(state, "w0")
    check_in(state, "w0", now=101.0)
    check_in(state, "w1", now=101.0)
    assert poll(state, "w2") == WorkerPollReply(kill=False, training_over=False)

    assert launching.launcher_poll(state, now=110.0).kill == ["w2"]
    resumed = JobState.from_dict(state.to_dict())
    assert [poll(resumed, worker).kill for worker in ("w0", "w1", "w2")] == [False, False, True]


def test_worker_poll_says_when_the_training_is_over_and_refuses_an_unknown_worker() -> None:
    state = started(2)
    ready(state, "w0", "w1")
    assert poll(state, "w1") == WorkerPollReply(kill=False, training_over=False)
    exited(state, "w0", 0, training_ended=True)

    assert poll(state, "w1") == WorkerPollReply(kill=False, training_over=True)
    assert poll(state, "w0").training_over  # an exited worker may still be asked about
    with pytest.raises(StateError, match="w7 is not a worker of job"):
        poll(state, "w7")
