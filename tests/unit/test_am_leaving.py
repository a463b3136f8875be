"""Leaving (``master/transitions/leaving.py``): a worker that received SIGTERM is queued for removal or cancelled."""

from __future__ import annotations

import pytest

from lightning_elan.master.state import CANCELLED, LEAVE, StateError
from lightning_elan.master.transitions import leaving, requests
from lightning_elan.protocol.contract import LeaveReply
from tests.unit.am_steps import commit, decide, ready, started


def test_leaves_join_one_request_at_the_head_of_the_queue() -> None:
    state = started(4)
    add = requests.scale(state, "add", count=1)

    first = leaving.request_leave(state, "w1", now=3.0)
    second = leaving.request_leave(state, "w3", now=4.0)

    assert first == second == LeaveReply("queued", "r2")
    head = state.pending[0]
    assert (head.action, head.workers, head.requested_at) == (LEAVE, ["w1", "w3"], 3.0)
    assert state.pending[1].request_id == add.request_id
    assert leaving.request_leave(state, "w1") == first  # repeating changes nothing
    assert state.projected_size() == 3


def test_the_leave_is_decided_first_and_resolved_against_the_members() -> None:
    state = started(3)
    leaving.request_leave(state, "w2")

    plan = decide(state)
    assert (plan.action, plan.leavers, plan.members) == (LEAVE, ["w2"], ["w0", "w1"])
    assert leaving.request_leave(state, "w2") == LeaveReply("queued", plan.request_id)
    commit(state, plan)
    with pytest.raises(StateError, match=r"^worker w2 has left the job$"):
        leaving.request_leave(state, "w2")


def test_the_last_member_cannot_leave_and_a_finished_job_has_nothing_to_leave() -> None:
    state = started(2)
    leaving.request_leave(state, "w0")

    with pytest.raises(StateError, match="is the last member of job 'job'"):
        leaving.request_leave(state, "w1")
    requests.shutdown(state)
    assert leaving.request_leave(state, "w1") == LeaveReply("finished", None)


def test_a_joiner_whose_plan_is_not_decided_is_cancelled_with_its_partners() -> None:
    state = started(1)
    requests.scale(state, "add", count=2)
    ready(state, "w1")

    assert leaving.request_leave(state, "w1", now=7.0) == LeaveReply("cancelled", "r1")
    assert state.pending == []
    assert state.pending_workers["w1"].status == state.pending_workers["w2"].status == CANCELLED
    assert (state.failures[-1]["outcome"], state.failures[-1]["at"]) == ("cancelled", 7.0)
    assert leaving.request_leave(state, "w1") == LeaveReply("cancelled", "r1")  # idempotent
