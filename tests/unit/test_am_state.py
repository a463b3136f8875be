from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from lightning_elan.master.state import MAX_FAILURES, JobState, StateError
from lightning_elan.master.transitions import adjustments, launching, requests, status_view
from lightning_elan.master.transitions.adjustments import MAX_COMPLETING
from lightning_elan.protocol.contract import (
    MAX_WORLD_SIZE,
    AdjustmentPlan,
    AdjustmentReport,
    AMStatus,
    CoordinateReply,
    CoordinateRequest,
    EmptyReply,
    LauncherPollReply,
    RegisterRequest,
    ScaleReply,
    SpawnOrder,
    StartJobReply,
    WaitPlanReply,
    WorkerExitReply,
)
from tests.unit.am_steps import exited


def started(nproc: int = 3) -> JobState:
    state = JobState(job="job")
    launching.start_job(state, nproc, coordinate_every=5)
    return state


def ready(state: JobState, workers: list[str]) -> None:
    for worker in workers:
        requests.register(state, RegisterRequest(worker, host="host", device="cpu", pid=100))


def decide(state: JobState, step: int = 10) -> AdjustmentPlan:
    reply = adjustments.coordinate(state, CoordinateRequest(state.member_ids[0], state.generation, step))
    assert reply.decision == "adjust" and reply.plan is not None, reply
    return reply.plan


def adjust(state: JobState, action: str, **arguments: object) -> AdjustmentPlan:
    """Request, register the joiners, decide and commit one adjustment; returns its plan."""
    new_workers = requests.scale(state, action, **arguments).new_workers
    ready(state, new_workers)
    plan = decide(state)
    # the new generation commits it
    adjustments.coordinate(state, CoordinateRequest(plan.members[0], plan.generation, 10))
    return plan


def test_start_job_creates_generation_zero_and_is_idempotent() -> None:
    state = JobState(job="job")

    first = launching.start_job(state, 3)
    again = launching.start_job(state, 5)

    assert first == again == StartJobReply(0, ["w0", "w1", "w2"])
    assert requests.scale(state, "add", count=1).new_workers == ["w3"]


def test_add_spawns_new_workers_then_plans_them_in_after_they_report_ready() -> None:
    state = started(2)

    reply = requests.scale(state, "add", count=2)
    first_poll = launching.launcher_poll(state)
    second_poll = launching.launcher_poll(state)

    assert reply == ScaleReply("r1", ["w2", "w3"])
    assert first_poll == LauncherPollReply([SpawnOrder("w2", "r1"), SpawnOrder("w3", "r1")], [], False)
    assert second_poll.spawn == []
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 5)) == CoordinateReply.none(joiners_coming=True)
    ready(state, ["w2", "w3"])
    plan = decide(state, step=10)
    assert plan.to_dict() == {
        "request_id": "r1",
        "action": "add",
        "generation": 1,
        "previous_generation": 0,
        "step": 10,
        "members": ["w0", "w1", "w2", "w3"],
        "previous_members": ["w0", "w1"],
        "joiners": ["w2", "w3"],
        "leavers": [],
        "sources": {"w2": "w0", "w3": "w1"},
        "hosts": {"w0": None, "w1": None, "w2": "host", "w3": "host"},
    }


def test_decision_waits_until_all_new_workers_reported() -> None:
    state = started(2)
    requests.scale(state, "add", count=2)

    ready(state, ["w2"])

    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 10)) == CoordinateReply.none(joiners_coming=True)
    ready(state, ["w3"])
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 15)).decision == "adjust"


def test_at_step_defers_the_decision_to_the_first_coordination_at_or_after_it() -> None:
    state = started(2)
    requests.scale(state, "add", count=1, at_step=20)
    ready(state, ["w2"])

    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 15)) == CoordinateReply.none(joiners_coming=True)
    assert decide(state, step=25).step == 25


def test_only_the_head_request_is_considered() -> None:
    state = started(2)
    requests.scale(state, "add", count=1, at_step=100)
    requests.scale(state, "remove", count=1)

    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 10)) == CoordinateReply.none(joiners_coming=True)
    assert [request["request_id"] for request in status_view.status(state).pending] == ["r1", "r2"]


def test_remove_takes_the_newest_members_first() -> None:
    state = started(3)
    adjust(state, "add", count=1)  # w3 joins in generation 1

    plan = adjust(state, "remove", count=2)

    assert plan.leavers == ["w2", "w3"]  # w3: latest generation; w2: highest id of generation 0
    assert plan.members == ["w0", "w1"]
    assert plan.sources == {}
    assert state.generation == 2 and state.member_ids == ["w0", "w1"]


def test_remove_ranks_names_ranks_and_keeps_the_order_of_stayers() -> None:
    state = started(4)

    plan = adjust(state, "remove", ranks=[2, 0])

    assert plan.leavers == ["w0", "w2"]
    assert plan.members == ["w1", "w3"]
    first = status_view.status(state).members[0]
    assert (first.worker_id, first.rank, first.host, first.device, first.pid) == ("w1", 0, None, None, None)


def test_ranks_are_validated_against_the_projected_generation() -> None:
    state = started(3)

    with pytest.raises(StateError, match=r"^rank 5 does not exist in generation 0 \(world size 3\)$"):
        requests.scale(state, "remove", ranks=[5])
    requests.scale(state, "remove", count=1)
    with pytest.raises(StateError, match=r"^rank 2 does not exist in generation 1 \(world size 2\)$"):
        requests.scale(state, "remove", ranks=[2])
    assert requests.scale(state, "remove", ranks=[1]).request_id == "r2"


def test_migrate_adds_and_removes_the_newest_old_members_in_one_adjustment() -> None:
    state = started(3)

    plan = adjust(state, "migrate", count=2)

    assert plan.joiners == ["w3", "w4"]
    assert plan.leavers == ["w1", "w2"]
    assert plan.members == ["w0", "w3", "w4"]
    assert plan.sources == {"w3": "w0", "w4": "w0"}


def test_migrating_every_worker_sources_from_the_leavers() -> None:
    state = started(2)

    plan = adjust(state, "migrate", count=2)

    assert plan.members == ["w2", "w3"]
    assert plan.sources == {"w2": "w0", "w3": "w1"}


def test_to_resizes_against_the_projected_size() -> None:
    state = started(3)

    grow = requests.scale(state, "to", size=5)
    shrink = requests.scale(state, "to", size=4)

    assert grow.new_workers == ["w3", "w4"]
    assert shrink.new_workers == []
    assert state.projected_size() == 4
    with pytest.raises(StateError, match="already has 4 workers"):
        requests.scale(state, "to", size=4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"action": "add", "count": 0}, "count must be ≥ 1, got 0"),
        ({"action": "add"}, "add needs a count"),
        ({"action": "remove", "count": 3}, "cannot remove all 3 workers"),
        ({"action": "remove", "count": 4}, "cannot remove 4 workers: the job has only 3"),
        ({"action": "remove", "ranks": [0, 1, 2]}, "cannot remove all 3 workers"),
        ({"action": "remove", "ranks": [1, 1]}, "ranks must be distinct"),
        ({"action": "remove", "ranks": [0], "count": 1}, "count or ranks, not both"),
        ({"action": "migrate", "count": 4}, "cannot migrate 4 workers: the job has only 3"),
        ({"action": "to", "size": 0}, "size must be ≥ 1, got 0"),
        ({"action": "add", "count": 1, "at_step": -1}, "at_step must be ≥ 0"),
        ({"action": "grow", "count": 1}, "unknown action 'grow'"),
    ],
)
def test_invalid_scale_requests_are_refused_without_side_effects(arguments: dict, message: str) -> None:
    state = started(3)
    before = state.to_dict()

    with pytest.raises(StateError, match=message):
        requests.scale(state, **arguments)
    assert state.to_dict() == before


def test_unknown_workers_are_refused() -> None:
    state = started(2)

    with pytest.raises(StateError, match=r"^unknown worker w9$"):
        requests.register(state, RegisterRequest("w9"))
    with pytest.raises(StateError, match=r"^unknown worker w9$"):
        adjustments.coordinate(state, CoordinateRequest("w9", 0, 1))
    with pytest.raises(StateError, match=r"^unknown worker w9$"):
        exited(state, "w9", 1)


def test_requests_before_start_job_are_refused() -> None:
    with pytest.raises(StateError, match="has not been started"):
        requests.scale(JobState(job="job"), "add", count=1)


def test_in_flight_plan_refuses_scale_and_is_returned_again() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    plan = decide(state, step=10)

    with pytest.raises(StateError, match=r"^adjustment in flight \(generation 0 → 1\); retry$"):
        requests.scale(state, "add", count=1)
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 10)) == CoordinateReply.adjust(plan)
    assert adjustments.wait_plan(state, "w2") == WaitPlanReply.with_plan(plan)


def test_coordinate_of_the_new_generation_commits_the_plan() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    decide(state)

    assert adjustments.coordinate(state, CoordinateRequest("w0", 1, 12)) == CoordinateReply.none()
    assert state.generation == 1
    assert state.member_ids == ["w0", "w1", "w2"]
    assert state.in_flight is None
    assert state.member("w2").host == "host"
    with pytest.raises(StateError, match=r"^generation 0 is not current \(current generation 1\)$"):
        adjustments.coordinate(state, CoordinateRequest("w0", 0, 12))
    with pytest.raises(StateError, match="generation 5 is not current"):
        adjustments.coordinate(state, CoordinateRequest("w0", 5, 12))


def test_a_joiners_report_commits_but_a_leavers_does_not() -> None:
    state = started(3)
    requests.scale(state, "migrate", count=1)
    ready(state, ["w3"])
    decide(state)

    adjustments.report(state, AdjustmentReport("w2", 1, "leaver", pause_s=0.0, bytes_sent=100, bytes_received=0))
    assert state.generation == 0
    assert exited(state, "w2", 0) == WorkerExitReply(True)
    adjustments.report(state, AdjustmentReport("w3", 1, "joiner", pause_s=0.5, bytes_sent=0, bytes_received=100,
                                               startup_s=4.0))
    assert state.generation == 1
    assert state.member_ids == ["w0", "w1", "w3"]


def test_adjustment_record_is_produced_when_every_new_member_reported() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    decide(state, step=10)

    assert adjustments.report(state, AdjustmentReport("w2", 1, "joiner", pause_s=0.3, bytes_received=1000,
                                                      startup_s=3.5)) is None
    assert adjustments.report(state, AdjustmentReport("w0", 1, "stayer", pause_s=0.2, bytes_sent=1000,
                                                      bytes_received=0)) is None
    record = adjustments.report(state, AdjustmentReport("w1", 1, "stayer", pause_s=0.1, bytes_sent=0,
                                                        bytes_received=24))

    assert record is not None
    assert {key: record[key] for key in ("request_id", "action", "step", "generation", "joiners", "leavers")} == {
        "request_id": "r1",
        "action": "add",
        "step": 10,
        "generation": 1,
        "joiners": ["w2"],
        "leavers": [],
    }
    assert record["pause_s"] == {"w0": 0.2, "w1": 0.1}
    assert record["joiner_startup_s"] == {"w2": 3.5}
    assert record["bytes_replicated"] == 1024
    assert record["requested_at"] <= record["all_reported_at"] <= record["decided_at"] <= record["completed_at"]
    assert status_view.status(state).last_adjustment == record
    # a late duplicate changes nothing
    assert adjustments.report(state, AdjustmentReport("w1", 1, "stayer", pause_s=0.1)) is None


def test_report_from_a_worker_outside_the_adjustment_is_refused() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    decide(state)
    adjustments.coordinate(state, CoordinateRequest("w0", 1, 11))
    requests.scale(state, "add", count=1)

    with pytest.raises(StateError, match="w3 is not part of the adjustment to generation 1"):
        adjustments.report(state, AdjustmentReport("w3", 1, "joiner"))
    with pytest.raises(StateError, match="no adjustment to generation 7"):
        adjustments.report(state, AdjustmentReport("w0", 7, "stayer"))


def test_a_joiner_exiting_before_the_decision_fails_its_request_and_cancels_its_partners() -> None:
    state = started(2)
    requests.scale(state, "add", count=2)
    launching.launcher_poll(state)
    ready(state, ["w2"])

    assert exited(state, "w3", 1) == WorkerExitReply(False)

    assert state.pending == []
    answer = adjustments.wait_plan(state, "w2")
    assert answer is not None and answer.status == "cancelled"
    assert "request r1 failed: worker w3 exited with code 1" in (answer.reason or "")
    assert exited(state, "w2", 0) == WorkerExitReply(True)
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 50)) == CoordinateReply.none()
    assert requests.scale(state, "add", count=1).new_workers == ["w4"]  # ids are never reused


def test_wait_plan_waits_while_nothing_is_decided() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])

    assert adjustments.wait_plan(state, "w2") is None
    with pytest.raises(StateError, match="unknown worker w7"):
        adjustments.wait_plan(state, "w7")


def test_shutdown_cancels_pending_requests_and_finishes_the_job() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)

    assert requests.shutdown(state, "training done") == EmptyReply()

    assert launching.launcher_poll(state) == LauncherPollReply([], [], finished=True)
    assert adjustments.wait_plan(state, "w2") == WaitPlanReply.cancelled("job shut down: training done")
    assert status_view.status(state).finished is True
    assert exited(state, "w0", 0) == WorkerExitReply(True)
    with pytest.raises(StateError, match="is finished"):
        requests.scale(state, "add", count=1)




def test_state_round_trips_through_json_mid_adjustment() -> None:
    state = started(3)
    adjust(state, "add", count=1)
    requests.scale(state, "remove", ranks=[0])
    decide(state)
    adjustments.report(state, AdjustmentReport("w0", 2, "leaver", bytes_sent=0))

    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))

    assert restored == state
    assert restored.in_flight is not None
    assert (adjustments.coordinate(restored, CoordinateRequest("w0", 1, 12))
            == adjustments.coordinate(state, CoordinateRequest("w0", 1, 12)))
    for worker in ("w1", "w2"):
        assert adjustments.report(restored, AdjustmentReport(worker, 2, "stayer", pause_s=0.1)) is None
    assert restored.generation == 2
    assert adjustments.report(restored, AdjustmentReport("w3", 2, "stayer", pause_s=0.1))["leavers"] == ["w0"]


# ---- topology-aware sources -----------------------------------------------------------------------------------------


def gpu_topology(host: str, socket: int, bus: int) -> dict:
    return {"host": host, "device_type": "cuda", "device_index": 0, "pci_bus_id": f"0000:{bus:02x}:00.0",
            "socket": socket}


def test_registered_topologies_route_sources_through_the_planner() -> None:
    # Elan fig. 9: w0, w1 on socket 0 of n0, w2 on socket 1, w3 on n1; joiner w4 near w2, w5 near w3
    state = started(4)
    places = {"w0": ("n0", 0, 1), "w1": ("n0", 0, 2), "w2": ("n0", 1, 0x81), "w3": ("n1", 0, 1)}
    for worker, (host, socket, bus) in places.items():
        topology = gpu_topology(host, socket, bus)
        requests.register(state, RegisterRequest(worker, host=host, device="cuda:0", pid=1, topology=topology))
    new = requests.scale(state, "add", count=2).new_workers
    requests.register(state, RegisterRequest(new[0], host="n0", device="cuda:1", pid=2,
                                             topology=gpu_topology("n0", 1, 0x82)))
    requests.register(state, RegisterRequest(new[1], host="n1", device="cuda:1", pid=3,
                                             topology=gpu_topology("n1", 0, 2)))

    plan = decide(state)

    assert plan.sources == {"w4": "w2", "w5": "w3"}
    assert [(t.source, t.joiner, t.level, t.wave, t.transport) for t in plan.transfers] == [
        ("w2", "w4", 2, 0, "shm"),
        ("w3", "w5", 2, 0, "shm"),
    ]
    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored.in_flight is not None and restored.in_flight.plan == plan


def test_a_missing_topology_falls_back_to_round_robin_without_transfers() -> None:
    state = started(2)
    requests.register(state, RegisterRequest("w0", host="n0", topology={"host": "n0"}))
    new = requests.scale(state, "add", count=2).new_workers
    ready(state, new)  # joiners register without a topology

    plan = decide(state)

    assert plan.sources == {"w2": "w0", "w3": "w1"}
    assert plan.transfers is None and "transfers" not in plan.to_dict()


def test_an_unreadable_topology_is_ignored() -> None:
    state = started(1)
    requests.register(state, RegisterRequest("w0", host="n0", topology={"no_host": True}))
    assert state.members[0].topology is None


def test_a_request_whose_worker_never_reports_fails_and_the_queue_moves_on() -> None:
    state = JobState(job="job")
    launching.start_job(state, 2, report_timeout_s=30)
    stuck = requests.scale(state, "add", count=1).new_workers
    behind = requests.scale(state, "add", count=1).new_workers
    assert [w.worker_id for w in launching.launcher_poll(state, now=1000.0).spawn] == stuck + behind
    ready(state, behind)
    assert launching.launcher_poll(state, now=1029.0).stop == []
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 5)).plan is None, \
        "the head request still waits for its worker"
    assert launching.launcher_poll(state, now=1031.0).stop == stuck
    assert adjustments.wait_plan(state, stuck[0]).status == "cancelled"
    assert "did not report ready within 30 s" in adjustments.wait_plan(state, stuck[0]).reason
    plan = decide(state, step=6)
    assert plan.joiners == behind
    assert JobState.from_dict(json.loads(json.dumps(state.to_dict()))).report_timeout_s == 30
    with pytest.raises(StateError, match="report_timeout_s"):
        launching.start_job(JobState(job="other"), 1, report_timeout_s=0)


# ---------------------------------------------------------------------- bad, stale and duplicated inputs


def refused_unchanged(state: JobState, call: Callable[[], object], message: str) -> None:
    """``call`` raises a StateError matching ``message`` and leaves the whole state as it was."""
    before = state.to_dict()
    with pytest.raises(StateError, match=message):
        call()
    assert state.to_dict() == before


def test_a_reordered_coordinate_of_an_earlier_step_is_ignored_as_stale() -> None:
    state = started(2)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 20, epoch=1, position=240))
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    before = state.to_dict()

    assert (adjustments.coordinate(state, CoordinateRequest("w0", 0, 15, epoch=1, position=180))
            == CoordinateReply.none())
    assert state.to_dict() == before, "a stale coordinate neither decides nor moves the progress back"
    plan = decide(state, step=20)
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 12)) == CoordinateReply.adjust(plan), \
        "in flight: same plan"
    assert status_view.status(state).step == 20


def test_a_new_generation_may_coordinate_at_an_earlier_step() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    plan = decide(state, step=20)

    # e.g. a redo
    assert adjustments.coordinate(state, CoordinateRequest("w0", plan.generation, 19)) == CoordinateReply.none()
    assert state.generation == 1 and status_view.status(state).step == 19


def test_workers_of_an_older_generation_cannot_coordinate_report_or_register() -> None:
    state = started(3)
    adjust(state, "remove", count=1)  # w2 leaves; generation 1 = w0, w1
    adjustments.report(state, AdjustmentReport("w2", 1, "leaver"))

    refused_unchanged(state, lambda: adjustments.coordinate(state, CoordinateRequest("w2", 1, 30)),
                      r"^worker w2 is not a member of generation 1$")
    refused_unchanged(state, lambda: adjustments.coordinate(state, CoordinateRequest("w0", 0, 30)),
                      r"^generation 0 is not current \(current generation 1\)$")
    refused_unchanged(state, lambda: requests.register(state, RegisterRequest("w2", host="h", pid=7)),
                      r"^worker w2 has left")
    adjust(state, "add", count=1)  # generation 2
    refused_unchanged(state, lambda: adjustments.report(state, AdjustmentReport("w2", 2, "stayer")),
                      r"^worker w2 is not part of the adjustment to generation 2$")


def test_scale_while_an_adjustment_is_in_flight_leaves_the_state_unchanged() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    ready(state, ["w2"])
    decide(state)

    refused_unchanged(state, lambda: requests.scale(state, "remove", count=1),
                      r"adjustment in flight \(generation 0 → 1\)")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: adjustments.coordinate(s, CoordinateRequest("w0", -1, 5)), r"^generation must be ≥ 0, got -1$"),
        (lambda s: adjustments.coordinate(s, CoordinateRequest("w0", 0, -5)), r"^step must be ≥ 0, got -5$"),
        (lambda s: adjustments.report(s, AdjustmentReport("w0", -2, "stayer")), r"^generation must be ≥ 0, got -2$"),
        (lambda s: adjustments.report(s, AdjustmentReport("w0", 1, "stayer", step=-1)), r"^step must be ≥ 0, got -1$"),
        (lambda s: adjustments.report(s, AdjustmentReport("w0", 0, "dancer")), r"unknown role 'dancer'"),
        (lambda s: requests.scale(s, "add", count=MAX_WORLD_SIZE), rf"at most {MAX_WORLD_SIZE} workers"),
        (lambda s: requests.scale(s, "to", size=MAX_WORLD_SIZE + 1), rf"at most {MAX_WORLD_SIZE} workers"),
        (lambda s: exited(s, "w77", 0), r"^unknown worker w77$"),
    ],
)
def test_out_of_range_values_are_refused_without_side_effects(call: Callable, message: str) -> None:
    state = started(2)
    refused_unchanged(state, lambda: call(state), message)


def test_start_job_refuses_absurd_sizes_and_hosts_that_are_not_names() -> None:
    with pytest.raises(StateError, match=rf"nproc must be ≤ {MAX_WORLD_SIZE}"):
        launching.start_job(JobState(job="job"), MAX_WORLD_SIZE + 1)
    with pytest.raises(StateError, match="hosts must be host names"):
        launching.start_job(JobState(job="job"), 2, hosts=["a", {"deep": ["b"]}])
    state = JobState(job="job")
    launching.start_job(state, 2, hosts={"w1": "b"})
    assert [m.host for m in status_view.status(state).members] == [None, "b"]


def test_a_duplicated_report_is_ignored_and_the_first_one_stands() -> None:
    state = started(2)
    plan = adjust(state, "add", count=1)
    adjustments.report(state, AdjustmentReport("w0", 1, "stayer", pause_s=0.5))
    before = state.to_dict()

    assert adjustments.report(state, AdjustmentReport("w0", 1, "stayer", pause_s=99.0)) is None
    assert state.to_dict() == before
    adjustments.report(state, AdjustmentReport("w1", 1, "stayer", pause_s=0.25))
    record = adjustments.report(state, AdjustmentReport("w2", 1, "joiner", startup_s=1.0))
    assert record is not None and record["pause_s"] == {"w0": 0.5, "w1": 0.25}
    assert adjustments.report(state, AdjustmentReport("w2", plan.generation, "joiner")) is None, \
        "late duplicate: recorded already"


# ---------------------------------------------------------------------- observability


def test_status_lists_each_members_last_step_and_where_it_comes_from() -> None:
    state = started(2)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 7), now=50.0)
    assert [(m.last_step, m.last_step_from) for m in status_view.status(state).members] == [
        (7, "coordinate"), (None, None)
    ]
    adjust(state, "add", count=1)  # decided at step 10; the new generation's rank 0 coordinates at 10
    adjustments.report(state, AdjustmentReport("w1", 1, "stayer"), now=60.0)
    adjustments.report(state, AdjustmentReport("w2", 1, "joiner", step=11), now=61.0)

    members = {m.worker_id: m for m in status_view.status(state).members}
    assert (members["w0"].last_step, members["w0"].last_step_from) == (10, "coordinate")
    assert (members["w1"].last_step, members["w1"].last_step_from) == (10, "report")  # the plan's step
    assert (members["w2"].last_step, members["w2"].last_step_from, members["w2"].last_seen_at) == (
        11, "report", 61.0
    )
    assert members["w2"].joined_generation == 1


def test_a_leavers_last_step_is_forgotten_with_it() -> None:
    state = started(3)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 3))
    adjust(state, "remove", ranks=[0])

    assert [m.worker_id for m in status_view.status(state).members] == ["w1", "w2"]
    assert set(state.progress.workers) <= {"w1", "w2"}


def test_a_joiner_that_never_reports_ready_is_listed_as_a_failed_request_with_its_reason() -> None:
    state = JobState(job="job")
    launching.start_job(state, 2, report_timeout_s=30)
    requests.scale(state, "add", count=1, at_step=5)
    launching.launcher_poll(state, now=1000.0)
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 4))

    launching.launcher_poll(state, now=1031.0)

    assert status_view.status(state).pending == []
    [failure] = status_view.status(state).failures
    assert failure["kind"] == "request" and failure["outcome"] == "failed"
    assert (failure["request_id"], failure["action"], failure["count"], failure["at_step"]) == ("r1", "add", 1, 5)
    assert failure["new_workers"] == ["w2"] and failure["step"] == 4
    assert failure["reason"] == "worker w2 did not report ready within 30 s"
    assert JobState.from_dict(json.loads(json.dumps(state.to_dict()))).failures == state.failures


def test_a_joiner_exit_before_or_after_its_decision_is_a_failure() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    exited(state, "w2", 3)
    requests.scale(state, "add", count=1)
    ready(state, ["w3"])
    decide(state)
    exited(state, "w3", 9)

    failures = status_view.status(state).failures
    assert [(f["kind"], f["outcome"], f.get("request_id") or f.get("worker_id")) for f in failures] == [
        ("request", "failed", "r1"), ("adjustment", "failed", "r2"), ("worker", "died", "w3")
    ]
    assert failures[0]["reason"] == "worker w2 exited with code 3 before its plan was decided"
    assert failures[1]["reason"] == "interrupted by a worker's death"  # its generation failed: a recovery follows
    assert failures[1]["generation"] == 1 and failures[1]["workers"] == ["w3"]
    assert status_view.status(state).recovery["dead"] == ["w3"]


def test_requests_cancelled_by_shutdown_are_listed_with_the_reason() -> None:
    state = started(2)
    requests.scale(state, "add", count=1)
    requests.scale(state, "remove", count=1)
    requests.shutdown(state, "user stop")

    failures = status_view.status(state).failures
    assert [(f["outcome"], f["request_id"], f["reason"]) for f in failures] == [
        ("cancelled", "r1", "job shut down: user stop"), ("cancelled", "r2", "job shut down: user stop")
    ]


def test_the_failure_history_is_bounded() -> None:
    state = started(2)
    for index in range(MAX_FAILURES + 7):
        state.record_failure({"kind": "request", "outcome": "failed", "request_id": f"r{index}", "reason": "x"})

    assert len(state.failures) == MAX_FAILURES
    assert state.failures[0]["request_id"] == "r7" and state.failures[-1]["request_id"] == f"r{MAX_FAILURES + 6}"


def test_an_adjustment_dropped_before_every_report_arrived_is_a_failure() -> None:
    state = started(2)
    for _ in range(MAX_COMPLETING + 1):
        adjust(state, "migrate", count=1)  # nobody reports

    [failure] = state.failures
    assert failure["kind"] == "adjustment" and failure["generation"] == 1
    assert failure["reason"].startswith("never completed: no report from w0, ")


def test_restart_count_round_trips_and_is_in_status() -> None:
    state = started(2)
    state.am_restarts = 2
    again = JobState.from_dict(json.loads(json.dumps(state.to_dict())))

    assert status_view.status(again).am == AMStatus(restarts=2)
    legacy = {key: value for key, value in state.to_dict().items() if key not in ("failures", "am_restarts")}
    assert JobState.from_dict(legacy).am_restarts == 0
