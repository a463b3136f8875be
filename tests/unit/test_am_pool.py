"""The standby pool's transitions (``master/transitions/pool.py``): refill, take, stop, exit, answer."""

from __future__ import annotations

from lightning_elan.master.state import CANCELLED, READY
from lightning_elan.master.transitions import pool, requests
from lightning_elan.protocol.contract import STANDBY_REQUEST
from tests.unit.am_steps import ready, started


def test_start_job_fills_the_pool_and_an_add_takes_the_ready_standby_first() -> None:
    state = started(2, standby=2)
    assert state.standby.workers == ["w2", "w3"]
    assert all(state.pending_workers[w].request_id == STANDBY_REQUEST for w in ("w2", "w3"))
    ready(state, "w3")

    reply = requests.scale(state, "add", count=1, now=5.0)

    assert reply.new_workers == ["w3"]  # ready before the older w2
    assert state.pending_workers["w3"].request_id == reply.request_id
    assert state.pending[0].all_reported_at == 5.0  # ready at once: nothing to start
    assert state.standby.workers == ["w2", "w4"]  # refilled with a new worker


def test_a_standby_that_never_reports_is_stopped_and_not_replaced() -> None:
    state = started(1, standby=1, report_timeout_s=10.0)
    requests.spawn_requested(state, now=100.0)

    assert pool.drop_unreported(state, now=105.0) == []
    assert pool.drop_unreported(state, now=111.0) == ["w1"]
    assert state.pending_workers["w1"].status == CANCELLED and state.standby.workers == []
    assert state.failures[-1]["kind"] == "standby" and state.failures[-1]["outcome"] == "cancelled"


def test_an_exited_standby_leaves_the_pool_and_others_are_not_standbys() -> None:
    state = started(1, standby=1)

    assert pool.exited(state, "w0", 1) is False  # a member: not the pool's
    assert pool.exited(state, "w1", 3) is True
    assert "w1" not in state.pending_workers and state.standby.workers == []
    assert state.failures[-1]["outcome"] == "died" and state.failures[-1]["returncode"] == 3


def test_a_standby_waits_with_standby_and_shutdown_cancels_the_pool() -> None:
    state = started(1, standby=1)
    ready(state, "w1")
    assert state.pending_workers["w1"].status == READY

    assert pool.idle_answer(state, "w1").status == "standby"
    assert pool.idle_answer(state, "w0").status == "wait"
    requests.shutdown(state, "bye")
    assert state.standby.workers == [] and state.pending_workers["w1"].status == CANCELLED
    assert pool.idle_answer(state, "w1").status == "wait"
