"""The ``status`` reply (``master/transitions/status_view.py``): what it shows, and that it changes nothing."""

from __future__ import annotations

import json

from lightning_elan.master.transitions import adjustments, requests, status_view
from lightning_elan.protocol.contract import CoordinateRequest, StatusReply
from tests.unit.am_steps import decide, exited, ready, started


def test_status_shows_members_pending_requests_and_the_plan_in_flight() -> None:
    state = started(2, hosts=["a", "b"], standby=1)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 4, epoch=1, position=40), now=9.0)
    requests.scale(state, "add", count=2)
    before = state.to_dict()

    status = status_view.status(state)

    assert state.to_dict() == before
    assert [(m.worker_id, m.rank, m.host) for m in status.members] == [("w0", 0, "a"), ("w1", 1, "b")]
    assert (status.members[0].last_step, status.members[0].last_step_from) == (4, "coordinate")
    assert (status.step, status.epoch, status.position) == (4, 1, 40)
    assert status.pending[0]["new_workers"] == ["w2", "w3"]
    assert status.pending[0]["worker_status"] == {"w2": "requested", "w3": "requested"}
    assert status.standby == {"target": 1, "workers": [{"worker_id": "w4", "status": "requested", "host": None}]}
    assert status.in_flight is None and status.recovery is None and status.enrolment is None

    ready(state, "w2", "w3")
    plan = decide(state)
    assert status_view.status(state).in_flight == plan


def test_the_status_body_has_the_keys_it_always_had_and_parses_back() -> None:
    state = started(2)
    ready(state, *requests.scale(state, "add", count=1).new_workers)
    decide(state)

    status = status_view.status(state)
    body = json.loads(json.dumps(status.to_body()))

    assert list(body) == ["job", "generation", "members", "step", "epoch", "position", "global_batch", "scaling",
                          "pending", "in_flight", "last_adjustment", "failures", "am", "recovery", "enrolment",
                          "standby", "sizing", "finished", "failed_reason", "finish_reason"]
    assert list(body["members"][0]) == ["worker_id", "rank", "host", "device", "pid", "joined_generation",
                                        "last_step", "last_step_from", "last_seen_at"]
    assert body["in_flight"] == status.in_flight.to_dict() and body["recovery"] is None
    assert StatusReply.from_body(body) == status

def test_status_shows_a_recovery_under_way() -> None:
    state = started(3)
    exited(state, "w1", 1)

    recovery = status_view.status(state).recovery

    assert (recovery["failure_id"], recovery["dead"], recovery["survivors"]) == ("f1", ["w1"], ["w0", "w2"])
    assert recovery["checked_in"] == [] and status_view.status(state).failures[-1]["kind"] == "worker"
