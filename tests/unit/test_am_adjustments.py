"""Adjustments (``master/transitions/adjustments.py``): the only code that changes ``members`` and ``generation``."""

from __future__ import annotations

from lightning_elan.master.state import JobState, Member
from lightning_elan.master.transitions import adjustments, requests
from lightning_elan.master.transitions.adjustments import MAX_COMPLETING
from lightning_elan.protocol.contract import (
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    RegisterReply,
    RegisterRequest,
)
from tests.unit.am_steps import commit, decide, ready, started


def test_generation_zero_forms_from_the_members_given() -> None:
    state = JobState(job="job")

    adjustments.form_generation_zero(state, [Member("w5", 0, host="a"), Member("w2", 0, host="b")])

    assert state.member_ids == ["w5", "w2"] and state.generation == 0 and state.host_of("w2") == "b"


def test_a_plan_changes_the_members_only_when_the_new_generation_commits_it() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 5)).plan is None  # w2 not ready yet
    ready(state, "w2")

    plan = decide(state, step=6)
    assert (plan.generation, plan.members, plan.joiners, plan.step) == (1, ["w0", "w1", "w2"], ["w2"], 6)
    assert state.member_ids == ["w0", "w1"] and state.in_flight is not None and state.pending == []
    assert adjustments.wait_plan(state, "w2").plan == plan

    commit(state, plan)
    assert state.member_ids == ["w0", "w1", "w2"] and state.generation == 1 and state.in_flight is None
    assert state.member("w2").joined_generation == 1 and "w2" not in state.pending_workers
    assert adjustments.wait_plan(state, "w2").plan == plan  # asked again after the commit


def test_remove_takes_the_newest_members_and_they_leave_the_job() -> None:
    state = started(3)
    requests.scale(state, "add", count=1)
    ready(state, "w3")
    commit(state, decide(state, step=10), step=11)

    requests.scale(state, "remove", count=2)
    plan = decide(state, step=20)
    commit(state, plan, step=21)

    assert plan.leavers == ["w2", "w3"] and state.member_ids == ["w0", "w1"]
    assert state.left_workers == ["w2", "w3"]


def test_the_record_comes_once_every_new_member_reported_and_only_once() -> None:
    state = started(2)
    requests.scale(state, "remove", count=1)
    plan = decide(state)

    assert adjustments.report(state, AdjustmentReport("w1", 1, "leaver", pause_s=0.0), now=20.0) is None
    assert adjustments.report(state, AdjustmentReport("w0", 1, "stayer", pause_s=0.5), now=21.0) is not None
    assert state.last_adjustment["completed_at"] == 21.0 and state.last_adjustment["pause_s"] == {"w0": 0.5}
    assert state.completing == [] and state.member_ids == plan.members == ["w0"]
    assert adjustments.report(state, AdjustmentReport("w0", 1, "stayer")) is None  # a late duplicate


def test_adjustments_that_never_complete_are_dropped_and_recorded() -> None:
    state = started(1)
    for step in range(0, 10 * (MAX_COMPLETING + 1), 10):
        requests.scale(state, "add", count=1)
        ready(state, *state.pending[0].new_workers)
        commit(state, decide(state, step=step), step=step + 1)

    assert len(state.completing) == MAX_COMPLETING
    dropped = state.failures[-1]
    assert (dropped["kind"], dropped["generation"]) == ("adjustment", 1)
    assert dropped["reason"].startswith("never completed: no report from w0")


def test_members_hear_of_joiners_coming_until_they_are_in() -> None:
    state = started(2)
    register = lambda: requests.register(state, RegisterRequest("w0", host="host", device="cpu", pid=1))  # noqa: E731
    coordinate = lambda step: adjustments.coordinate(state, CoordinateRequest("w0", state.generation, step))  # noqa: E731
    assert register() == RegisterReply() and register().to_body() == {} and not coordinate(1).joiners_coming
    requests.scale(state, "add", count=1, at_step=20)
    assert register().to_body() == {"joiners_coming": True}  # a member registering now prepares from its first step
    reply = coordinate(3)
    assert reply.plan is None and reply.joiners_coming and reply.to_body()["joiners_coming"] is True
    assert CoordinateReply.from_body(reply.to_body()) == reply
    ready(state, "w2")
    commit(state, decide(state, step=20))
    assert not coordinate(21).joiners_coming and "joiners_coming" not in coordinate(22).to_body()
    requests.scale(state, "remove", count=1, at_step=50)
    assert not coordinate(23).joiners_coming  # a removal starts no worker
