"""The ``status`` reply (``master/transitions/status_view.py``): what it shows, and that it changes nothing."""

from __future__ import annotations

from lightning_elan.master.transitions import adjustments, recovering, requests, status_view
from lightning_elan.protocol.contract import CoordinateRequest
from tests.unit.am_steps import decide, ready, started


def test_status_shows_members_pending_requests_and_the_plan_in_flight() -> None:
    state = started(2, hosts=["a", "b"], standby=1)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 4, epoch=1, position=40), now=9.0)
    requests.scale(state, "add", count=2)
    before = state.to_dict()

    status = status_view.status(state)

    assert state.to_dict() == before
    assert [(m["worker_id"], m["rank"], m["host"]) for m in status["members"]] == [("w0", 0, "a"), ("w1", 1, "b")]
    assert (status["members"][0]["last_step"], status["members"][0]["last_step_from"]) == (4, "coordinate")
    assert (status["step"], status["epoch"], status["position"]) == (4, 1, 40)
    assert status["pending"][0]["new_workers"] == ["w2", "w3"]
    assert status["pending"][0]["worker_status"] == {"w2": "requested", "w3": "requested"}
    assert status["standby"] == {"target": 1, "workers": [{"worker_id": "w4", "status": "requested", "host": None}]}
    assert status["in_flight"] is None and status["recovery"] is None and status["enrolment"] is None

    ready(state, "w2", "w3")
    plan = decide(state)
    assert status_view.status(state)["in_flight"] == plan.to_dict()


def test_status_shows_a_recovery_under_way() -> None:
    state = started(3)
    recovering.worker_exit(state, "w1", 1)

    recovery = status_view.status(state)["recovery"]

    assert (recovery["failure_id"], recovery["dead"], recovery["survivors"]) == ("f1", ["w1"], ["w0", "w2"])
    assert recovery["checked_in"] == [] and status_view.status(state)["failures"][-1]["kind"] == "worker"
