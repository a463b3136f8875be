"""Whether the job is done (``master/transitions/finishing.py``): the AM decides it from the members' exits its launcher
reports, with what the rendezvous store said of each (``worker_exit``'s ``training_ended``/``script_failed``); the
launcher only obeys (``test_launcher_exits.py``)."""

from __future__ import annotations

import json

import pytest

from lightning_elan.master.state import JobState
from lightning_elan.master.transitions import launching, requests, status_view
from lightning_elan.protocol.contract import FINISHED_BY_LAUNCHER, WorkerExitReply
from tests.unit.am_steps import commit, decide, exited, ready, started


def finished_training(state: JobState) -> bool:
    """The AM ended the job because its training is complete (not failed, not stopped)."""
    return state.finished and state.finish_reason == FINISHED_BY_LAUNCHER and state.failed_reason is None


@pytest.mark.parametrize(
    ("exits", "done"),
    [
        ([("w0", 0), ("w1", 0)], True),
        ([("w0", 0), ("w1", -15)], True),  # stopped by SIGTERM once its training loop was over
        ([("w0", 0), ("w1", 143)], True),  # the same, through a shell
        ([("w1", -15), ("w0", 0)], True),  # the SIGTERM first: the recovery it starts is not needed
        ([("w0", 0)], False),  # w1 still runs
        ([("w0", 0), ("w1", 1)], False),  # a crash is not a finish
        ([("w0", 0), ("w1", -9)], False),
    ],
)
def test_the_job_is_done_once_every_member_exited_having_finished(exits: list[tuple[str, int]], done: bool) -> None:
    state = started(2)
    for worker, returncode in exits:
        exited(state, worker, returncode)

    assert finished_training(state) is done
    assert status_view.status(state).finish_reason == (FINISHED_BY_LAUNCHER if done else None)


def test_members_all_stopped_by_sigterm_show_no_finished_training() -> None:
    state = started(2)
    exited(state, "w0", -15)

    assert exited(state, "w1", -15) == WorkerExitReply(False, recovering=False)
    assert not finished_training(state) and state.failed_reason == "every worker of generation 0 died"


@pytest.mark.parametrize(
    ("exits", "done"),
    [
        # w1 killed after the last step, before its own mark, once w0's training loop ended (storm seed 356)
        ([("w0", 0, {"training_ended": True}), ("w1", -9, {})], True),
        ([("w1", -9, {}), ("w0", 0, {"training_ended": True})], True),
        ([("w0", 0, {}), ("w1", -9, {})], False),  # w0's exit 0 alone (a leaver's, say) does not show it complete
        # w1's script raised after its training, then crashed at exit: that failure fails the job
        ([("w0", 0, {"training_ended": True}), ("w1", -6, {"training_ended": True, "script_failed": True})], False),
    ],
)
def test_a_death_once_a_members_training_ended_is_a_finish_unless_a_script_failed(
    exits: list[tuple[str, int, dict[str, bool]]], done: bool
) -> None:
    state = started(2)
    for worker, returncode, store_marks in exits:
        exited(state, worker, returncode, **store_marks)

    assert finished_training(state) is done


def test_a_member_killed_after_the_training_ended_fails_nothing() -> None:
    """The AM's half of ``test_worker_faults.py::test_a_member_killed_after_the_training_ended_fails_nothing``: the
    recovery begun for w1 (and its replacement) ends with the job, which ends as finished."""
    state = started(3, replace_failed=True)

    assert exited(state, "w1", -9, training_ended=True).recovering
    exited(state, "w0", 0, training_ended=True)
    assert not state.finished  # w2 still runs
    exited(state, "w2", 0, training_ended=True)

    assert finished_training(state) and [f["kind"] for f in state.failures] == ["worker", "request"]
    assert state.failures[-1]["outcome"] == "cancelled"  # the replacement, never needed


def test_a_plan_whose_stayers_finished_instead_is_stranded_and_the_job_is_done() -> None:
    """Rank 0 never learned of the plan (the AM died before answering): the members trained to the end; the plan stays
    in flight for the launcher to stop its joiners."""
    state = started(2)
    ready(state, *requests.scale(state, "add", count=1).new_workers)
    plan = decide(state)
    exited(state, "w0", 0)
    exited(state, "w1", 0)

    assert finished_training(state)
    assert status_view.status(state).in_flight == plan and plan.joiners == ["w2"]


def test_members_that_left_for_the_plan_in_flight_are_not_done_its_joiners_carry_on() -> None:
    """A full migration: the only member leaves; the job ends when its joiner, the new member, finishes."""
    state = started(1)
    ready(state, *requests.scale(state, "migrate", count=1).new_workers)
    plan = decide(state)

    assert exited(state, "w0", 0) == WorkerExitReply(True)
    assert not state.finished
    commit(state, plan)
    exited(state, "w1", 0)
    assert finished_training(state)


def test_the_launchers_poll_finishes_a_job_done_by_a_commit_that_came_after_the_exits() -> None:
    """The AM's clock for a job of ``elan run``: the joiner's commit reached the AM after every exit (it reported,
    then finished training and exited, and its report arrived last); the next poll ends the job."""
    state = started(1)
    ready(state, *requests.scale(state, "migrate", count=1).new_workers)
    plan = decide(state)
    exited(state, "w0", 0)
    exited(state, "w1", 0)
    commit(state, plan)
    assert not state.finished

    assert launching.launcher_poll(state).finished and finished_training(state)


def test_the_exits_survive_a_round_trip_of_the_state_and_an_older_state_still_loads() -> None:
    state = started(2)
    exited(state, "w0", 0, training_ended=True)
    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))
    exited(restored, "w1", -9)
    assert finished_training(restored)

    older = {key: value for key, value in started(2).to_dict().items() if key != "exits"}
    older["trained_out"] = ["w0"]
    assert JobState.from_dict(older).trained_out == ["w0"]
