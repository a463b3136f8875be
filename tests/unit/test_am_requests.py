"""Requests and the queue (``master/transitions/requests.py``): validation, queueing, readiness, failures, shutdown."""

from __future__ import annotations

import pytest

from lightning_elan.master.state import CANCELLED, READY, REQUESTED, SPAWNED, StateError
from lightning_elan.master.transitions import requests
from lightning_elan.protocol.contract import EmptyReply, ScaleReply, WorkerExitReply
from tests.unit.am_steps import exited, ready, started


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"action": "remove", "count": 3}, "cannot remove all 3 workers"),
        ({"action": "to", "size": 3}, "the job already has 3 workers (counting pending requests); nothing to do"),
        ({"action": "remove", "ranks": [3]}, "rank 3 does not exist in generation 0 (world size 3)"),
        ({"action": "add", "count": 0}, "count must be ≥ 1, got 0"),
        ({"action": "grow", "count": 1}, "unknown action 'grow' (expected add, remove, migrate or to)"),
    ],
)
def test_a_request_is_validated_against_the_projected_size(arguments: dict, message: str) -> None:
    state = started(3)
    before = state.to_dict()

    with pytest.raises(StateError) as refused:
        requests.scale(state, **arguments)

    assert str(refused.value) == message
    assert state.to_dict() == before


def test_queued_workers_are_spawned_once_and_ready_when_all_registered() -> None:
    state = started(2)
    reply = requests.scale(state, "add", count=2, now=1.0)
    assert reply == ScaleReply("r1", ["w2", "w3"])
    assert state.pending_workers["w2"].status == REQUESTED and state.projected_size() == 4

    spawned = requests.spawn_requested(state, now=2.0)
    assert [order.worker_id for order in spawned] == ["w2", "w3"]
    assert requests.spawn_requested(state, now=3.0) == []

    ready(state, "w2", now=4.0)
    assert state.pending[0].all_reported_at is None
    ready(state, "w3", now=5.0)
    assert state.pending_workers["w3"].status == READY and state.pending[0].all_reported_at == 5.0


def test_a_request_whose_worker_never_reports_fails_and_its_workers_are_stopped() -> None:
    state = started(1, report_timeout_s=10.0)
    requests.scale(state, "add", count=2)
    requests.spawn_requested(state, now=0.0)
    ready(state, "w1", now=1.0)

    assert requests.fail_unreported(state, now=10.0) == []
    assert requests.fail_unreported(state, now=10.5) == ["w1", "w2"]
    assert state.pending == [] and state.pending_workers["w1"].status == CANCELLED
    failure = state.failures[-1]
    assert (failure["kind"], failure["outcome"], failure["new_workers"]) == ("request", "failed", ["w1", "w2"])
    assert failure["reason"] == "worker w2 did not report ready within 10 s"


def test_a_joiner_that_exits_before_the_decision_fails_its_request_and_cancels_its_partner() -> None:
    state = started(1)
    requests.scale(state, "add", count=2)
    requests.spawn_requested(state, now=0.0)

    assert exited(state, "w1", 1) == WorkerExitReply(False)
    assert state.pending == [] and "w1" not in state.pending_workers
    assert state.pending_workers["w2"].status == CANCELLED
    assert exited(state, "w2", 0) == WorkerExitReply(True)  # a cancelled joiner's exit 0


def test_shutdown_cancels_the_queue_once() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    assert state.pending_workers["w2"].status in (REQUESTED, SPAWNED)

    assert requests.shutdown(state, "enough") == EmptyReply()
    assert state.finished and state.finish_reason == "enough" and state.pending == []
    assert state.pending_workers["w2"].status == CANCELLED
    assert state.failures[-1]["outcome"] == "cancelled" and state.failures[-1]["reason"] == "job shut down: enough"
    failures = list(state.failures)
    requests.shutdown(state, "again")
    assert state.finish_reason == "enough" and state.failures == failures
    with pytest.raises(StateError, match="is finished"):
        requests.scale(state, "add", count=1)
