"""Enrolment (``master/transitions/enrolling.py``): workers of a scheduler enrol, the job starts, the AM's clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elan.master import server
from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.state import SPAWNED, JobState, StateError, WorkerExit
from lightning_elan.master.store import FileStore
from lightning_elan.master.transitions import enrolling
from lightning_elan.protocol import AMClient
from lightning_elan.protocol.contract import FINISHED_BY_AM, EnrolReply, EnrolRequest, WorkerExitRequest
from tests.unit.am_steps import exited


def enrolling_job(minimum: int, maximum: int) -> JobState:
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(minimum, maximum, start_grace_s=2.0), coordinate_every=3)
    return state


def test_generation_zero_forms_from_the_workers_that_enrolled_after_the_grace() -> None:
    state = enrolling_job(2, 4)
    first = enrolling.enrol(state, EnrolRequest("a", 1), now=0.0)
    enrolling.enrol(state, EnrolRequest("b", 2), now=1.0)

    assert first.worker_id == "w0" and first.role == "waiting" and not state.started
    enrolling.housekeeping(state, now=2.5)
    assert not state.started  # the quorum came at 1.0: the grace runs to 3.0
    enrolling.housekeeping(state, now=3.0)
    assert state.started and state.member_ids == ["w0", "w1"] and state.member("w1").host == "b"
    reply = enrolling.enrol(state, EnrolRequest("a", 1, "w0"), now=3.1)
    assert (reply.role, reply.rank, reply.world_size, reply.coordinate_every) == ("member", 0, 2, 3)


def test_a_worker_that_enrols_after_the_start_is_a_joiner_of_its_own_add() -> None:
    state = enrolling_job(1, 2)
    enrolling.enrol(state, EnrolRequest("a", 1), now=0.0)
    enrolling.housekeeping(state, now=5.0)

    reply = enrolling.enrol(state, EnrolRequest("c", 3), now=6.0)

    assert reply.role == "joiner" and state.pending[0].new_workers == [reply.worker_id]
    assert state.pending_workers[reply.worker_id].status == SPAWNED
    with pytest.raises(StateError, match=r"has its 2 workers \(--max-workers\)"):
        enrolling.enrol(state, EnrolRequest("d", 4), now=7.0)


def test_the_job_finishes_once_every_member_trained_out() -> None:
    state = enrolling_job(2, 2)
    for host in ("a", "b"):
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)
    assert state.started  # full: at once

    exited(state, "w0", 0)
    enrolling.housekeeping(state, now=1.0)
    assert not state.finished
    exited(state, "w1", 0)
    enrolling.housekeeping(state, now=2.0)
    assert state.finished and state.finish_reason == FINISHED_BY_AM


def test_a_member_killed_after_the_last_step_before_the_others_exited_fails_nothing() -> None:
    """Etcd storm seed 9012: w1 was SIGKILLed once the job's last step was trained, before w0 and w2 exited 0; the
    AM opened a recovery none of them checked in to (their ``fit`` had returned) and failed the job ("no survivor
    checked in after f1"). The members' exits, with the marks their ``elan worker``s read, show the training
    complete: the job is done, as a job of ``elan run`` is."""
    state = enrolling_job(3, 3)
    for host in ("a", "b", "c"):
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)

    assert exited(state, "w1", -9).recovering
    exited(state, "w0", 0, training_ended=True)
    assert not state.finished
    exited(state, "w2", 0, training_ended=True)

    assert state.finished and state.finish_reason == FINISHED_BY_AM and state.failed_reason is None


def test_a_member_killed_mid_training_still_fails_the_generation() -> None:
    """The same exits without the marks of an ended training (a death mid-step; the survivors then exit 0 only if
    something else ended their scripts): not a finish."""
    state = enrolling_job(3, 3)
    for host in ("a", "b", "c"):
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)

    exited(state, "w1", -9)
    exited(state, "w0", 0)
    exited(state, "w2", 0)

    assert not state.finished and state.recovery is not None


def test_a_job_of_elan_run_takes_no_enrolment() -> None:
    with pytest.raises(StateError, match="does not take `elan worker`s"):
        enrolling.enrol(JobState(job="job"), EnrolRequest("a", 1))


@pytest.fixture
def enrolled_am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster("job", FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False)
    master.accept_enrolments(Enrolment(1, 2, start_grace_s=0.0), coordinate_every=1)
    master.start()
    yield master
    master.stop()


def _enrol(client: AMClient, host: str) -> EnrolReply:
    return EnrolReply.from_body(client.request(EnrolRequest.TYPE, EnrolRequest(host, 1).to_body()))


def _exit(client: AMClient, worker: str, returncode: int, **marks: bool) -> None:
    client.request(WorkerExitRequest.TYPE, WorkerExitRequest(worker, returncode, **marks).to_body())


def test_the_am_of_a_finished_job_serves_on_until_its_cancelled_joiner_learned_it(enrolled_am) -> None:
    """Etcd storm seed 9003: the job finished while a joiner warmed up; the AM stopped at once and the joiner asked an
    AM that was gone until its scheduler killed it. Now the AM is over once that joiner was told and exited."""
    with AMClient(enrolled_am.address, "job", timeout_s=2.0, retries=2) as client:
        assert _enrol(client, "a").role == "member"
        joiner = _enrol(client, "b")
        assert joiner.role == "joiner"
        _exit(client, "w0", 0, training_ended=True)

        assert enrolled_am.finished and not enrolled_am.over
        assert client.wait_plan(joiner.worker_id, 1.0).status == "cancelled"
        assert not enrolled_am.over  # told, but its exit is not reported yet
        _exit(client, joiner.worker_id, 0)
        assert enrolled_am.over


def test_the_am_of_a_finished_job_stops_after_the_linger_without_its_joiners_exit(enrolled_am, monkeypatch) -> None:
    """A cancelled joiner whose exit is never reported (its `elan worker` was SIGKILLed) holds the AM only so long."""
    with AMClient(enrolled_am.address, "job", timeout_s=2.0, retries=2) as client:
        _enrol(client, "a")
        _enrol(client, "b")
        _exit(client, "w0", 0, training_ended=True)
    assert not enrolled_am.over
    monkeypatch.setattr(server, "FINISH_LINGER_S", 0.0)
    assert enrolled_am.over


def test_the_am_of_a_finished_job_serves_on_for_the_exit_of_a_worker_that_left() -> None:
    """A leaver still exiting when the job finished: its `elan worker` reads the marks in the store the AM serves and
    reports the exit, so the AM is not over before it did (or the linger passed). `elan run` reports every exit."""
    state = JobState(job="job", enrolment=Enrolment(1, 3), left_workers=["w1", "w2"])
    state.exits["w2"] = WorkerExit(0, left=True)
    assert state.unreported_leavers() == ["w1"]
    state.exits["w1"] = WorkerExit(0, left=True)
    assert state.unreported_leavers() == []
    assert JobState(job="job", left_workers=["w1"]).unreported_leavers() == []
