"""The AM's ``leave``: a worker that received SIGTERM asks to be removed (``master/transitions/leaving.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.store import FileStore
from lightning_elan.master.transitions import adjustments, launching, leaving, requests, status_view
from lightning_elan.protocol import AMClient, AMError
from lightning_elan.protocol.contract import (
    AdjustmentReport,
    CoordinateRequest,
    LeaveReply,
    RegisterRequest,
    WaitPlanReply,
    WorkerExitReply,
)
from tests.unit.am_steps import exited

JOB = "job"


def started(nproc: int = 3) -> JobState:
    state = JobState(job=JOB)
    launching.start_job(state, nproc, coordinate_every=50)
    return state


def ready(state: JobState, workers: list[str]) -> None:
    for worker in workers:
        requests.register(state, RegisterRequest(worker, host="host", device="cpu", pid=100))


def coordinate(state: JobState, step: int):
    return adjustments.coordinate(state, CoordinateRequest(state.member_ids[0], state.generation, step)).plan


def commit(state: JobState, plan, step: int) -> None:
    """A member of the new generation speaks: the plan commits."""
    stayer = next(worker for worker in plan.members if worker not in plan.joiners)
    adjustments.report(state, AdjustmentReport(stayer, plan.generation, "stayer", step=step))


def test_a_member_leaves_at_the_next_coordination_ahead_of_a_scale_request_still_warming_up() -> None:
    state = started(3)
    requests.scale(state, "add", count=1)  # r1: its joiner w3 never reports ready while w1 leaves

    reply = leaving.request_leave(state, "w1")

    assert reply == LeaveReply("queued", "r2")
    pending = status_view.status(state).pending
    assert [(r["request_id"], r["action"], r["workers"]) for r in pending] == [
        ("r2", "leave", ["w1"]), ("r1", "add", None)
    ]
    assert state.projected_size() == 3  # 3 - w1 + w3
    plan = coordinate(state, 7)  # any step: the worker side coordinates at once, not at a multiple of 50
    assert plan is not None
    assert (plan.action, plan.request_id, plan.step) == ("leave", "r2", 7)
    assert (plan.leavers, plan.members, plan.joiners) == (["w1"], ["w0", "w2"], [])
    assert [r.request_id for r in state.pending] == ["r1"]


def test_a_repeated_leave_changes_nothing_before_during_and_after_the_adjustment() -> None:
    state = started(3)
    first = leaving.request_leave(state, "w2")
    snapshot = state.to_dict()

    assert leaving.request_leave(state, "w2") == first and state.to_dict() == snapshot
    plan = coordinate(state, 3)
    # a leaver in flight
    assert leaving.request_leave(state, "w2") == LeaveReply("queued", plan.request_id)
    # a leaver's exit 0 is expected, committed or not
    assert exited(state, "w2", 0) == WorkerExitReply(True)
    commit(state, plan, 4)
    with pytest.raises(StateError, match="worker w2 has left the job"):
        leaving.request_leave(state, "w2")


def test_leaves_before_the_decision_share_one_adjustment() -> None:
    state = started(4)

    assert leaving.request_leave(state, "w3").request_id == leaving.request_leave(state, "w1").request_id == "r1"
    plan = coordinate(state, 2)

    assert plan is not None and (plan.leavers, plan.members) == (["w1", "w3"], ["w0", "w2"])


def test_rank0_may_leave() -> None:
    state = started(2)
    leaving.request_leave(state, "w0")

    plan = coordinate(state, 1)

    assert plan is not None and (plan.leavers, plan.members) == (["w0"], ["w1"])


def test_the_last_member_unknown_and_departed_workers_are_refused() -> None:
    single = started(1)
    with pytest.raises(StateError, match="worker w0 is the last member of job 'job': it cannot leave"):
        leaving.request_leave(single, "w0")

    state = started(2)
    leaving.request_leave(state, "w1")
    with pytest.raises(StateError, match="worker w0 is the last member"):
        leaving.request_leave(state, "w0")  # w1 is already leaving
    with pytest.raises(StateError, match="unknown worker w9"):
        leaving.request_leave(state, "w9")
    with pytest.raises(StateError, match="has not been started"):
        leaving.request_leave(JobState(job=JOB), "w0")


def test_a_joiner_whose_plan_is_not_decided_is_cancelled_with_its_request() -> None:
    state = started(2)
    requests.scale(state, "add", count=2)  # r1: w2, w3
    ready(state, ["w2"])

    reply = leaving.request_leave(state, "w3")

    assert reply == LeaveReply("cancelled", "r1")
    assert state.pending == [] and leaving.request_leave(state, "w3") == reply  # idempotent
    for joiner in ("w2", "w3"):  # the partner is cancelled too: both wait_plans answer cancelled
        answer = adjustments.wait_plan(state, joiner)
        assert answer is not None and answer.status == "cancelled" and "SIGTERM" in (answer.reason or "")
    (failure,) = state.failures
    assert (failure["outcome"], failure["request_id"], failure["action"]) == ("cancelled", "r1", "add")
    assert exited(state, "w3", 0) == WorkerExitReply(True)
    assert coordinate(state, 50) is None


def test_a_joiner_of_the_plan_in_flight_leaves_once_it_is_a_member() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    plan = coordinate(state, 50)
    assert plan is not None and plan.joiners == ["w2"]

    assert leaving.request_leave(state, "w2") == LeaveReply("queued", "r2")
    assert coordinate(state, 50) == plan  # the plan in flight first
    commit(state, plan, 51)
    leave = coordinate(state, 52)

    assert leave is not None and (leave.leavers, leave.members) == (["w2"], ["w0", "w1"])


def test_a_leave_whose_worker_is_gone_fails_instead_of_a_plan_that_changes_nothing() -> None:
    state = started(3)
    leaving.request_leave(state, "w2")
    state.members = [member for member in state.members if member.worker_id != "w2"]  # e.g. removed as crashed

    assert coordinate(state, 5) is None
    (failure,) = state.failures
    assert failure["outcome"] == "failed" and failure["workers"] == ["w2"]
    assert "worker w2 asked to leave but is no longer a member" in failure["reason"]


def test_a_finished_job_has_nothing_to_leave() -> None:
    state = started(2)
    requests.shutdown(state, "all members finished")

    assert leaving.request_leave(state, "w1") == LeaveReply("finished", None)


def test_a_leave_request_survives_a_restart_and_old_states_load() -> None:
    state = started(3)
    leaving.request_leave(state, "w1")

    restored = JobState.from_dict(state.to_dict())
    plan = coordinate(restored, 4)
    assert plan is not None and plan.leavers == ["w1"]

    old = started(3)
    requests.scale(old, "add", count=1)
    saved = old.to_dict()
    for request in saved["pending"]:
        del request["workers"]  # a state saved before leave existed
    assert JobState.from_dict(saved).pending[0].workers is None


# ---------------------------------------------------------------------- through the server


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False).start()
    yield master
    master.stop()


def test_leave_over_the_wire_wakes_a_cancelled_joiners_wait_plan(am: ApplicationMaster) -> None:
    with AMClient(am.address, JOB, timeout_s=1.0, retries=1) as client:
        client.request("start_job", {"nproc": 2, "coordinate_every": 50})
        assert client.leave("w1") == LeaveReply("queued", "r1")
        assert client.status()["pending"][0]["action"] == "leave"
        with pytest.raises(AMError, match="w0 is the last member"):
            client.leave("w0")
        joiner = client.scale("add", count=1)["new_workers"][0]
        answers: list[WaitPlanReply] = []
        thread = threading.Thread(target=lambda: answers.append(AMClient(am.address, JOB).wait_plan(joiner, 5.0)))
        thread.start()
        time.sleep(0.2)  # the joiner's wait_plan is parked
        woken = time.monotonic()
        assert client.leave(joiner).outcome == "cancelled"
        thread.join(5.0)

    assert answers and answers[0].status == "cancelled" and time.monotonic() - woken < 1.0


def test_a_leaver_killed_after_it_left_does_not_fail_the_job() -> None:
    """Found by the failure storms: a removed worker SIGKILLed after it left stopped the job ('w2 failed (was
    killed by SIGKILL): stopping job'), in flight or after the generation without it was formed."""
    state = started(3)
    requests.scale(state, "remove", count=1)
    plan = coordinate(state, 3)
    (leaver,) = plan.leavers
    assert exited(state, leaver, -9) == WorkerExitReply(False, left=True)  # in flight, serving nobody
    commit(state, plan, 3)
    assert exited(state, leaver, -9) == WorkerExitReply(False, left=True)  # after it left
    assert state.recovery is None and not state.finished


def test_a_migrating_leaver_killed_while_it_serves_its_joiner_is_a_failure() -> None:
    state = started(1)
    requests.scale(state, "migrate", count=1)
    ready(state, ["w1"])
    plan = coordinate(state, 3)
    (leaver,) = plan.leavers
    assert plan.sources == {"w1": leaver}  # the only member: the joiner's source
    reply = exited(state, leaver, -9)
    assert reply.recovering is True and state.recovery is not None
