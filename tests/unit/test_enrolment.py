"""Workers started by a scheduler enrol with the AM (``master/enrolment.py`` and ``master/transitions/enrolling.py``):
when the job starts, who is in generation 0, joiners after the start, refusals, silent waiters, the end of the job.
Pure state: no processes, no sockets; times are given explicitly."""

from __future__ import annotations

import pytest

from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import enrolling, launching, requests, status_view
from lightning_elan.protocol.contract import EnrolRequest, RegisterRequest
from tests.unit.am_steps import exited


def enrolling_job(minimum: int = 2, maximum: int = 3, grace: float = 5.0) -> JobState:
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(minimum, maximum, grace), coordinate_every=4, join_timeout_s=30.0)
    return state


def enrol(state: JobState, now: float, host: str = "h", worker_id: str | None = None):
    return enrolling.enrol(state, EnrolRequest(host, 1000, worker_id), now=now)


def test_the_job_waits_for_the_minimum_then_the_grace() -> None:
    state = enrolling_job(grace=5.0)
    first = enrol(state, 0.0, "a")
    assert (first.worker_id, first.role) == ("w0", "waiting") and not state.started
    assert enrol(state, 1.0, "b").role == "waiting"  # quorum at t=1: the grace for a third begins
    enrolling.housekeeping(state, now=5.9)
    assert not state.started
    assert enrol(state, 5.9, worker_id="w0").role == "waiting"
    enrolling.housekeeping(state, now=6.0)
    assert state.started and state.member_ids == ["w0", "w1"] and state.generation == 0
    member = enrol(state, 6.1, worker_id="w1")
    assert (member.role, member.rank, member.world_size, member.coordinate_every) == ("member", 1, 2, 4)
    assert [m.host for m in state.members] == ["a", "b"]
    assert state.min_workers == 2  # the same N: below it a recovery waits for joiners


def test_the_maximum_starts_the_job_at_once_and_refuses_more() -> None:
    state = enrolling_job(minimum=1, maximum=2, grace=100.0)
    enrol(state, 0.0)
    assert not state.started
    assert enrol(state, 0.5).role == "member"  # the second fills the job: it starts now, no grace
    assert state.started and state.world_size == 2
    with pytest.raises(StateError, match="has its 2 workers \\(--max-workers\\)"):
        enrol(state, 1.0)


def test_after_the_start_a_worker_is_a_joiner_of_an_add_request() -> None:
    state = enrolling_job(minimum=2, maximum=3, grace=0.0)
    enrol(state, 0.0)
    enrol(state, 0.0)
    assert state.started
    joiner = enrol(state, 10.0, "c")
    assert (joiner.worker_id, joiner.role) == ("w2", "joiner")
    (request,) = state.pending
    assert (request.action, request.new_workers) == ("add", ["w2"])
    assert state.pending_workers["w2"].status == "spawned"  # its report timeout runs from now
    requests.register(state, RegisterRequest("w2", host="c", device="cpu", pid=7))
    assert state.pending_workers["w2"].status == "ready"
    with pytest.raises(StateError, match="this worker is not needed"):
        enrol(state, 11.0)  # 2 members + 1 pending joiner = the maximum


def test_a_joiner_learns_the_launch_world_of_the_job_and_it_survives_the_am() -> None:
    """Generation 0's size, what the members' ``configure_model`` built for: a joiner's launcher did not start the job,
    so it learns it at its enrolment (also from an AM that took the state over), whatever the job's size since."""
    state = enrolling_job(minimum=2, maximum=4, grace=0.0)
    enrol(state, 0.0)
    member = enrol(state, 0.0)
    assert (member.role, member.world_size, state.launch_world_size) == ("member", 2, 2)
    assert enrol(state, 10.0, "c").launch_world_size == 2
    restored = JobState.from_dict(state.to_dict())
    assert enrol(restored, 11.0, "d").launch_world_size == 2
    saved_before = {key: value for key, value in state.to_dict().items() if key != "launch_world_size"}
    assert JobState.from_dict(saved_before).launch_world_size == 0  # a state an older AM saved: not known


def test_a_silent_waiter_is_dropped_before_the_start() -> None:
    state = enrolling_job(minimum=2, maximum=3, grace=1.0)
    enrol(state, 0.0)  # w0 never polls again
    enrol(state, 10.0)  # w1: quorum at t=10
    enrol(state, 20.0, worker_id="w1")
    enrolling.housekeeping(state, now=20.0)  # w0 silent 20 s > 15 s: dropped, below the quorum again
    assert not state.started
    with pytest.raises(StateError, match="not enrolled"):
        enrol(state, 20.5, worker_id="w0")
    enrol(state, 21.0)  # w2
    enrolling.housekeeping(state, now=22.5)
    assert state.member_ids == ["w1", "w2"]


def test_scale_cannot_start_workers_of_a_scheduler() -> None:
    state = enrolling_job(minimum=2, maximum=4, grace=0.0)
    enrol(state, 0.0)
    enrol(state, 0.0)
    for action in ("add", "migrate"):
        with pytest.raises(StateError, match="started by their scheduler"):
            requests.scale(state, action, count=1)
    assert requests.scale(state, "remove", count=1).new_workers == []


def test_a_job_of_elan_run_takes_no_enrolment_and_a_finished_job_none_either() -> None:
    plain = JobState(job="job")
    launching.start_job(plain, 2)
    with pytest.raises(StateError, match="does not take `elan worker`s"):
        enrol(plain, 0.0)
    state = enrolling_job(minimum=1, maximum=1)
    enrol(state, 0.0)
    exited(state, "w0", 0)
    enrolling.housekeeping(state, now=1.0)
    assert state.finished
    with pytest.raises(StateError, match="has finished"):
        enrol(state, 2.0)


def test_once_a_member_finished_training_a_new_worker_is_refused() -> None:
    """A member exited 0: the job's training is complete (the AM finishes it at its next housekeeping); a worker
    enrolling in between is refused, not queued as a joiner the AM would leave behind (found by the etcd storms)."""
    state = enrolling_job(minimum=2, maximum=3, grace=0.0)
    enrol(state, 0.0)
    enrol(state, 0.0)
    exited(state, "w0", 0)
    with pytest.raises(StateError, match="has finished training"):
        enrol(state, 1.0)
    assert not state.pending


def test_enrolment_survives_a_round_trip_of_the_state() -> None:
    state = enrolling_job(minimum=3, maximum=3)
    enrol(state, 0.0)
    restored = JobState.from_dict(state.to_dict())
    assert restored.enrolment == state.enrolment
    assert enrol(restored, 1.0, worker_id="w0").role == "waiting"


@pytest.mark.parametrize(("minimum", "maximum", "problem"), [(0, 1, "≥ 1"), (3, 2, "less than --min-workers")])
def test_bad_rules(minimum: int, maximum: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Enrolment(minimum, maximum)


def test_status_shows_the_waiting_workers_then_the_start() -> None:
    state = enrolling_job(minimum=2, maximum=3, grace=5.0)
    assert status_view.status(JobState(job="run")).enrolment is None  # a job of `elan run`
    enrol(state, 0.0, "a")
    assert status_view.status(state).enrolment == {"min_workers": 2, "max_workers": 3, "started": False,
                                                   "waiting": [{"worker_id": "w0", "host": "a", "pid": 1000}]}
    enrol(state, 0.0, "b")
    enrolling.housekeeping(state, now=5.0)
    assert status_view.status(state).enrolment == {"min_workers": 2, "max_workers": 3, "started": True,
                                                   "waiting": []}
