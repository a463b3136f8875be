"""A host lost without a word (powered off, paused, cut off the network): the AM of a job of `elan worker`s takes a
worker whose `elan worker` stopped polling for the heartbeat timeout for dead (``master/heartbeats.py``,
``recovering.worker_lost``). Before, nothing but the survivors' collective timeout (300 s by default) noticed it."""

from __future__ import annotations

import pytest

from lightning_elan.master.enrolment import MIN_HEARTBEAT_TIMEOUT_S, Enrolment
from lightning_elan.master.heartbeats import DEAF_S, Heartbeats, watched_workers
from lightning_elan.master.state import REQUESTED, JobState
from lightning_elan.master.transitions import enrolling, recovering, requests
from lightning_elan.protocol.contract import EnrolRequest, RecoverRequest, WaitPlanReply, WorkerPollRequest
from tests.unit.am_steps import exited


def running_job(workers: int = 3) -> JobState:
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(workers - 1, workers, start_grace_s=10.0), coordinate_every=1)
    for host in "abcdefgh"[:workers]:
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)
    assert state.started and state.member_ids == [f"w{i}" for i in range(workers)]
    return state


def test_a_worker_is_silent_once_not_heard_from_for_the_timeout() -> None:
    beats = Heartbeats(timeout_s=30.0)
    for worker in ("w0", "w1"):
        beats.heard(worker, 100.0)
    for now in range(101, 130):  # the AM looks every second (every 0.25 s in fact); w1 went quiet at 100
        if now % 5 == 0:  # w0 polls every 5 s
            beats.heard("w0", float(now))
        assert beats.silent(["w0", "w1"], float(now)) == {}
    assert beats.silent(["w0", "w1"], 130.0) == {"w1": 30.0}


def test_a_worker_never_heard_from_counts_from_the_moment_it_is_watched() -> None:
    beats = Heartbeats(timeout_s=30.0)  # an AM that just took over: nobody polled it yet
    assert beats.silent(["w0", "w1"], 50.0) == {}
    for now in range(51, 80):
        beats.heard("w1", float(now))
        assert beats.silent(["w0", "w1"], float(now)) == {}
    beats.heard("w1", 80.0)
    assert beats.silent(["w0", "w1"], 80.0) == {"w0": 30.0}


def test_the_ams_own_stall_is_not_taken_for_its_workers_silence() -> None:
    beats = Heartbeats(timeout_s=30.0)
    beats.heard("w0", 0.0)
    assert beats.silent(["w0", "w1"], 1.0) == {}
    beats.heard("w1", 61.0)  # the AM itself stopped for a minute: nobody could reach it; w1's poll waited for it
    assert beats.silent(["w0", "w1"], 61.0) == {}
    for now in range(62, 90):
        beats.heard("w1", float(now))
        assert beats.silent(["w0", "w1"], float(now)) == {}
    beats.heard("w1", 90.0)
    assert beats.silent(["w0", "w1"], 90.0) == {"w0": 30.0}  # silent 1 s before the AM's stall, 29 s after it
    for now in range(91, 120):  # w1 fell silent after its poll at 90 (the one during the stall counts from 61 on)
        beats.heard("w0", float(now))
        beats.silent(["w0", "w1"], float(now))
    assert beats.silent(["w0", "w1"], 120.0) == {"w1": 30.0}


def test_the_watched_workers_are_the_running_members_and_joiners() -> None:
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(2, 3, start_grace_s=0.0), coordinate_every=1)
    for host in "ab":
        enrolling.enrol(state, EnrolRequest(host, 1), now=0.0)
    enrolling.housekeeping(state, now=1.0)
    joiner = enrolling.enrol(state, EnrolRequest("c", 1), now=2.0).worker_id  # warming up
    asked = requests.queue_add(state, 3.0).new_workers[0]  # `elan scale add`: the scheduler's worker is to come

    assert state.pending_workers[asked].status == REQUESTED
    assert watched_workers(state) == ["w0", "w1", joiner]
    recovering.worker_lost(state, joiner, 31.0)
    assert watched_workers(state) == ["w0", "w1"] and joiner not in state.pending_workers
    assert state.recovery is None  # a joiner not yet in a plan: its request fails, the members train on


def test_a_lost_member_fails_its_generation_and_is_declared_dead() -> None:
    state = running_job(3)

    reply = recovering.worker_lost(state, "w1", 31.0)

    assert reply.recovering and reply.failed_generations == [0]
    assert "w1" in state.declared_dead and state.recovery is not None and "w1" in state.recovery.dead
    assert watched_workers(state) == ["w0", "w2"]
    assert recovering.worker_poll(state, WorkerPollRequest("w1")).kill  # its `elan worker`, if it comes back
    assert not recovering.worker_poll(state, WorkerPollRequest("w0")).kill


def test_the_exit_a_lost_worker_reports_later_is_recorded_and_fails_nothing_more() -> None:
    state = running_job(3)
    recovering.worker_lost(state, "w1", 31.0)
    failures = list(state.failures)

    assert state.unreported_leavers() == ["w1"]  # the AM of a finished job serves on a while for its `elan worker`

    reply = exited(state, "w1", -9)  # its host came back: its `elan worker` killed the command and reports it

    assert not reply.recovering and state.exits["w1"].returncode == -9 and state.failures == failures
    assert state.unreported_leavers() == [] and not state.exits["w1"].lost


def test_no_worker_is_watched_before_the_start_nor_once_the_training_is_over() -> None:
    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(2, 2, start_grace_s=0.0), coordinate_every=1)
    enrolling.enrol(state, EnrolRequest("a", 1), now=0.0)
    assert watched_workers(state) == []  # waiting workers: the enrolment's own silence rule
    enrolling.enrol(state, EnrolRequest("b", 1), now=0.0)
    assert watched_workers(state) == ["w0", "w1"]
    exited(state, "w0", 0, training_ended=True)
    assert watched_workers(state) == []  # a member trained out: nobody waits for the others in a collective
    assert JobState(job="job").enrolment is None and watched_workers(JobState(job="job")) == []


def test_the_heartbeat_timeout_is_at_least_two_polls() -> None:
    with pytest.raises(ValueError, match="--heartbeat-timeout must be ≥ 15 s"):
        Enrolment(1, 2, heartbeat_timeout_s=10.0)
    assert Enrolment.from_dict({"min_workers": 1, "max_workers": 2}).heartbeat_timeout_s == 30.0  # an older state


def test_a_lost_worker_that_speaks_again_is_told_it_was_declared_dead() -> None:
    """Its host came back: the command's failure watch saw the failure, and it asks to recover. Before, the AM
    answered "worker w1 has left the job" (once the recovery was over) or "unknown worker" (a lost joiner), and the
    worker raised a RuntimeError out of `fit`; now the reply says it was declared dead, and its process ends."""
    state = running_job(3)
    recovering.worker_lost(state, "w1", 31.0)
    during = recovering.recover(state, RecoverRequest("w1", 0, has_state=True, step=4))
    for survivor in ("w0", "w2"):
        recovering.recover(state, RecoverRequest(survivor, 0, has_state=True, step=4))
    assert state.recovery is None  # the plan formed: w1 is a worker that left

    after = recovering.recover(state, RecoverRequest("w1", 0, has_state=True, step=4))

    for reply in (during, after, WaitPlanReply.from_body(after.to_body())):
        assert reply.status == "cancelled" and reply.declared_dead and "declared dead" in (reply.reason or "")
    assert not WaitPlanReply.cancelled("job finished").declared_dead


def test_nobody_is_lost_while_the_am_hears_nobody_and_each_clock_restarts_when_it_hears_again() -> None:
    """The AM's own host cut off for a minute: every `elan worker` falls silent at once. Declaring them all dead would
    end the job; the members only wait for the AM at their next coordination point. When the link is back their
    polls come one by one: the first must not make the others look lost."""
    beats = Heartbeats(timeout_s=30.0)
    for now in range(0, 61):
        assert beats.silent(["w0", "w1", "w2"], float(now)) == {}
    assert beats.deaf
    beats.heard("w0", 61.0)  # the AM hears one host again
    assert beats.silent(["w0", "w1", "w2"], 61.0) == {} and not beats.deaf
    for now in range(62, 91):
        beats.heard("w0", float(now))
        assert beats.silent(["w0", "w1", "w2"], float(now)) == {}
    assert beats.silent(["w0", "w1", "w2"], 91.0) == {"w1": 30.0, "w2": 30.0}  # really gone: lost a timeout later


def test_a_worker_that_polled_long_before_the_ams_network_went_out_is_not_lost() -> None:
    """The cut at 100 s: w1 had polled last at 93.5 s, the others just before the cut. The AM finds itself deaf
    (nobody for DEAF_S) before w1's silence reaches the shortest timeout."""
    beats = Heartbeats(timeout_s=MIN_HEARTBEAT_TIMEOUT_S)
    beats.heard("w1", 93.5)
    for worker in ("w0", "w2"):
        beats.heard(worker, 100.0)
    for now in range(94, 130):
        assert beats.silent(["w0", "w1", "w2"], float(now)) == {}
    assert beats.deaf and DEAF_S < MIN_HEARTBEAT_TIMEOUT_S - 6.5


def test_a_poll_answered_right_after_the_ams_stall_counts_from_its_arrival() -> None:
    beats = Heartbeats(timeout_s=30.0)
    beats.silent(["w0", "w1"], 0.0)
    beats.heard("w1", 60.0)  # the AM stopped from 0 to 60; w1's queued poll is read before its next look
    beats.heard("w0", 60.0)
    for now in range(60, 90):
        beats.heard("w0", float(now))
        assert beats.silent(["w0", "w1"], float(now)) == {}
    assert beats.silent(["w0", "w1"], 90.0) == {"w1": 30.0}  # not moved on by the stall: 30 s after its poll
