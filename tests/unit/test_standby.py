"""Standby workers (``elan run --standby K``): the pool's arithmetic and the AM's bookkeeping, in milliseconds."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lightning_elan.cli_status import format_status
from lightning_elan.master.standby import STANDBY_REQUEST, StandbyPool
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import adjustments, launching, leaving, pool, requests, status_view
from lightning_elan.protocol.contract import (
    CoordinateRequest,
    RegisterRequest,
    SpawnOrder,
    StatusReply,
    WaitPlanReply,
    WorkerExitReply,
)
from tests.unit.am_steps import exited


def test_the_pool_gives_the_readiest_oldest_first_and_says_what_is_missing() -> None:
    pool = StandbyPool(target=3, workers=["w3", "w4", "w5"])
    readiness = {"w3": 1, "w4": 2, "w5": 2}
    assert pool.take(2, readiness.__getitem__) == ["w4", "w5"]
    assert pool.workers == ["w3"] and pool.missing() == 2
    assert pool.take(5, readiness.__getitem__) == ["w3"] and pool.take(1, readiness.__getitem__) == []
    assert pool.discard("w9") is False
    with pytest.raises(ValueError, match="0 to 64"):
        StandbyPool(target=65)


def job_with_standby(nproc: int = 2, standby: int = 1) -> JobState:
    state = JobState(job="job")
    launching.start_job(state, nproc, coordinate_every=1, standby=standby)
    return state


def ready(state: JobState, worker: str) -> None:
    requests.register(state, RegisterRequest(worker, host="h", device="cpu", pid=100))


def test_standbys_start_with_the_job_and_wait_without_deadline() -> None:
    state = job_with_standby(2, standby=2)
    spawned = launching.launcher_poll(state, now=1.0).spawn
    assert spawned == [SpawnOrder(worker, STANDBY_REQUEST) for worker in ("w2", "w3")]
    ready(state, "w2")
    assert adjustments.wait_plan(state, "w2") is None and pool.idle_answer(state, "w2") == WaitPlanReply.standby()
    assert pool.idle_answer(state, "w0") == WaitPlanReply.wait()
    assert status_view.status(state).standby == {"target": 2, "workers": [
        {"worker_id": "w2", "status": "ready", "host": "h"}, {"worker_id": "w3", "status": "spawned", "host": None}]}
    assert state.projected_size() == 2  # standbys are not members-to-be
    assert status_view.status(JobState(job="plain")).standby is None


def test_an_add_takes_a_ready_standby_is_decided_at_once_and_the_pool_refills() -> None:
    state = job_with_standby(2, standby=1)
    launching.launcher_poll(state, now=1.0)
    ready(state, "w2")

    reply = requests.scale(state, "add", count=1)

    assert reply.new_workers == ["w2"] and state.standby.workers == ["w3"]
    assert launching.launcher_poll(state, now=2.0).spawn == [SpawnOrder("w3", STANDBY_REQUEST)]
    plan = adjustments.coordinate(state, CoordinateRequest("w0", 0, 5)).plan  # no process start to wait for
    assert plan is not None and plan.joiners == ["w2"] and plan.members == ["w0", "w1", "w2"]
    assert adjustments.wait_plan(state, "w2").plan == plan


def test_an_add_beyond_the_pool_takes_the_standbys_and_starts_the_rest() -> None:
    state = job_with_standby(2, standby=1)
    launching.launcher_poll(state, now=1.0)
    reply = requests.scale(state, "add", count=2)
    assert reply.new_workers == ["w2", "w3"] and state.standby.workers == ["w4"]
    # w2 (standby, not ready yet) and w3 start
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 5)).plan is None
    ready(state, "w2")
    ready(state, "w3")
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 6)).plan.joiners == ["w2", "w3"]


def test_a_standby_that_dies_leaves_the_pool_and_a_sigtermed_one_is_replaced() -> None:
    state = job_with_standby(2, standby=2)
    launching.launcher_poll(state, now=1.0)
    assert exited(state, "w2", -9) == WorkerExitReply(False)
    assert state.standby.workers == ["w3"] and "w2" not in state.pending_workers
    assert status_view.status(state).failures[-1]["kind"] == "standby"
    assert leaving.request_leave(state, "w3").outcome == "cancelled"
    assert state.standby.workers == ["w4", "w5"]  # the pool is back at its target (w2's place too)
    assert adjustments.wait_plan(state, "w3").status == "cancelled"
    assert exited(state, "w3", 0) == WorkerExitReply(True)


def test_a_standby_that_never_reports_is_stopped() -> None:
    state = job_with_standby(2, standby=1)
    launching.launcher_poll(state, now=1.0)
    assert launching.launcher_poll(state, now=1.0 + state.report_timeout_s + 1).stop == ["w2"]
    assert state.standby.workers == [] and adjustments.wait_plan(state, "w2").status == "cancelled"


def test_the_end_of_the_job_cancels_the_standbys() -> None:
    state = job_with_standby(2, standby=1)
    launching.launcher_poll(state, now=1.0)
    requests.shutdown(state, "done")
    assert adjustments.wait_plan(state, "w2").status == "cancelled" and state.standby.workers == []
    assert exited(state, "w2", 0) == WorkerExitReply(True)


def test_the_pool_survives_a_round_trip_of_the_state_and_is_validated() -> None:
    state = job_with_standby(2, standby=1)
    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored.standby == StandbyPool(target=1, workers=["w2"])
    with pytest.raises(StateError, match="0 to 64"):
        launching.start_job(JobState(job="j"), 2, standby=100)


def test_status_text_shows_the_pool() -> None:
    status = {"job": "j", "generation": 0, "members": [], "finished": False, "standby": {"target": 2, "workers": [
        {"worker_id": "w4", "status": "ready", "host": "h"}, {"worker_id": "w5", "status": "spawned", "host": None}]}}
    assert "standby: 1 of 2 ready (w4 ready, w5 spawned)" in format_status(StatusReply.from_body(status))


def test_a_standby_waits_past_its_deadline_until_the_job_ends(tmp_path, monkeypatch) -> None:
    """Through a real AM and ZeroMQ: a standby's long poll keeps waiting after the joiner's deadline (the AM answers
    `standby`) and ends `cancelled` at the shutdown; a joiner of an undecided request gives up at its deadline."""
    from lightning_elan.elastic import am_link
    from lightning_elan.elastic.am_link import AMLink
    from lightning_elan.master.server import ApplicationMaster
    from lightning_elan.master.store import FileStore
    from lightning_elan.protocol.client import AMClient
    from lightning_elan.protocol.contract import ROLE_JOINER, WorkerEnvironment

    monkeypatch.setattr(am_link, "WAIT_PLAN_POLL_S", 0.2)  # short long polls: the deadline is checked between them
    with ApplicationMaster("job", FileStore(tmp_path / "state.json"), register=False) as am, \
            AMClient(am.address, "job") as client:
        client.request("start_job", {"nproc": 2, "standby": 1})
        client.scale("add", count=2)  # takes w2 (the standby, not ready yet) and starts w3; the pool refills with w4

        def link(worker: str) -> AMLink:
            env = WorkerEnvironment.launched(job="job", worker_id=worker, role=ROLE_JOINER, am_address=am.address,
                                             store_address="127.0.0.1:1")
            return AMLink(env)

        started = time.monotonic()
        assert link("w3").wait_plan(0.5).status == "cancelled"  # a joiner: no plan within its 0.5 s
        assert time.monotonic() - started < 5.0
        standby = link("w4")
        timer = threading.Timer(1.5, lambda: AMClient(am.address, "job").request("shutdown", {"reason": "done"}))
        timer.start()
        started = time.monotonic()
        reply = standby.wait_plan(0.5)
        assert reply.status == "cancelled" and "done" in (reply.reason or "")
        assert time.monotonic() - started >= 1.4  # it waited on past its 0.5 s deadline
        timer.join()
