"""The AM's sizing on a JobState, without processes: measurements from coordinates, the profile sequence, the
throughput autoscaler's requests, straggler replacement (add, then remove once joined), the compute meter."""

from __future__ import annotations

import json

import pytest

from lightning_elan.elastic.compute import ComputeMeter
from lightning_elan.master import sizing
from lightning_elan.master.measure import Measurements
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import adjustments, enrolling, launching, requests
from lightning_elan.protocol.contract import (
    AutoscaleRequest,
    CoordinateRequest,
    ProfileRequest,
    ProtocolError,
    RegisterRequest,
    StragglersRequest,
    WorkerStats,
)


def started(nproc: int) -> JobState:
    state = JobState(job="job")
    launching.start_job(state, nproc, coordinate_every=1)
    return state


def train(state: JobState, steps: int, seconds_per_step: float, start: float, step: int = 0,
          global_batch: int = 12) -> tuple[float, int]:
    """Rank 0 coordinates ``steps`` times, ``seconds_per_step`` apart; returns (time, step) after them."""
    now = start
    for _ in range(steps):
        step += 1
        now += seconds_per_step
        for worker in list(state.pending_workers):  # the joiners started and reported ready
            requests.register(state, RegisterRequest(worker, host="h", device="cpu", pid=1))
        reply = adjustments.coordinate(state, CoordinateRequest(state.member_ids[0], state.generation, step,
                                                   global_batch=global_batch), now=now)
        if reply.plan is not None:  # the new generation's rank 0 coordinates: it commits
            adjustments.coordinate(state, CoordinateRequest(reply.plan.members[0], reply.plan.generation, step,
                                               global_batch=global_batch), now=now)
    return now, step


def test_measurements_skip_each_generations_first_interval_and_rate_the_rest() -> None:
    measured = Measurements()
    measured.observe_coordinate(0, 2, step=5, global_batch=12, now=100.0)  # baseline: holds the first step
    measured.observe_coordinate(0, 2, step=7, global_batch=12, now=101.0)
    measured.observe_coordinate(0, 2, step=9, global_batch=12, now=102.0)
    measured.observe_coordinate(1, 3, step=10, global_batch=12, now=110.0)  # new generation: baseline only
    measured.observe_coordinate(1, 3, step=13, global_batch=12, now=111.0)

    assert measured.rates() == {2: 24.0, 3: 36.0}
    assert measured.current.steps == 3 and measured.world_size == 3


def test_a_straggler_round_completes_when_every_member_reported() -> None:
    measured = Measurements()
    measured.observe_coordinate(0, 3, 1, 12, 1.0)
    members = ["w0", "w1", "w2"]
    flagged: list[str] = []
    for _ in range(20):
        for worker, seconds in (("w0", 0.1), ("w1", 0.3), ("w2", 0.1)):
            flagged = measured.observe_compute(worker, 0, seconds, members)
    assert flagged == ["w1"]
    assert measured.detector.scores()["w0"] == pytest.approx(1.0)


def test_worker_stats_are_validated() -> None:
    with pytest.raises(ProtocolError, match="steps must be >= 1"):
        WorkerStats.from_body({"worker_id": "w0", "generation": 0, "step": 3, "steps": 0, "compute_s": 0.1})
    with pytest.raises(ProtocolError, match="missing field"):
        WorkerStats.from_body({"worker_id": "w0", "generation": 0})


def test_stats_of_a_non_member_or_an_old_generation_are_ignored() -> None:
    state = started(2)
    assert adjustments.worker_stats(state, WorkerStats("w9", 0, 3, 1, 0.1)).ignored
    assert adjustments.worker_stats(state, WorkerStats("w0", 4, 3, 1, 0.1)).ignored


def test_profile_visits_2_then_1_then_returns_to_3_and_records_each_rate() -> None:
    state = started(3)
    sizing.start_profile(state, ProfileRequest(min=1, max=3, steps=4), now=0.0)
    now, step = train(state, 6, 0.5, 0.0)  # 3 workers at 24 samples/s
    sizing.tick(state, now)
    assert state.pending[0].action == "to" and state.pending[0].size == 2
    assert state.pending[0].cause["kind"] == "profile"
    now, step = train(state, 6, 0.6, now, step)  # the head decided and committed at the first coordinate
    assert state.world_size == 2
    sizing.tick(state, now)
    assert state.pending[0].size == 1
    now, step = train(state, 6, 1.0, now, step)
    sizing.tick(state, now)
    assert state.pending[0].size == 3 and len(state.pending[0].new_workers) == 2
    now, step = train(state, 2, 0.5, now, step)
    sizing.tick(state, now)
    assert state.sizing.profile is None
    result = state.sizing.profile_result
    assert result["rates"] == {1: pytest.approx(12.0), 2: pytest.approx(20.0), 3: pytest.approx(24.0)}
    model = sizing.throughput_model(result)
    assert model is not None and json.dumps(model)


def test_a_second_profile_or_autoscaler_during_a_profile_is_refused() -> None:
    state = started(2)
    sizing.start_profile(state, ProfileRequest(min=1, max=2), now=0.0)
    with pytest.raises(sizing.SizingError, match="already running"):
        sizing.start_profile(state, ProfileRequest(min=1, max=2), now=0.0)
    with pytest.raises(sizing.SizingError, match="profile of this job is running"):
        sizing.set_autoscale(state, AutoscaleRequest(policy="throughput"), now=0.0)
    with pytest.raises(sizing.SizingError, match="min_size"):
        sizing.start_profile(started(2), ProfileRequest(min=3, max=2), now=0.0)


def test_throughput_autoscaler_grows_while_it_pays_then_falls_back() -> None:
    state = started(1)
    sizing.set_autoscale(state, AutoscaleRequest(policy="throughput", every=3, threshold=0.1), now=0.0)
    now, step = train(state, 4, 1.0, 0.0)  # R1 = 12/s
    sizing.tick(state, now)
    assert state.pending[0].size == 2 and state.pending[0].cause["kind"] == "autoscale"
    now, step = train(state, 4, 0.6, now, step)  # R2 = 20/s: s = (20-12)/12 = 0.67
    sizing.tick(state, now)
    assert state.pending[0].size == 3
    now, step = train(state, 4, 0.59, now, step)  # R3 ≈ 20.3/s: s ≈ 0.03 < 0.1
    sizing.tick(state, now)
    assert state.pending[0].size == 2
    now, step = train(state, 4, 0.6, now, step)
    sizing.tick(state, now)
    assert not state.pending and state.sizing.decisions[-1]["decision"] == "hold"


def test_straggler_replace_adds_first_and_removes_the_straggler_once_the_replacement_joined() -> None:
    state = started(2)
    sizing.set_stragglers(state, StragglersRequest(mode="replace", window=1), now=0.0)
    now, step = train(state, 2, 0.5, 0.0)
    for _ in range(10):
        adjustments.worker_stats(state, WorkerStats("w0", 0, step, 1, 0.1))
        adjustments.worker_stats(state, WorkerStats("w1", 0, step, 1, 0.3))
    sizing.tick(state, now)
    assert state.pending[0].action == "add" and state.pending[0].cause["inputs"]["straggler"] == "w1"
    now, step = train(state, 2, 0.5, now, step)
    assert state.world_size == 3 and not state.pending
    sizing.tick(state, now)
    assert state.pending[0].action == "leave" and state.pending[0].workers == ["w1"]


def test_straggler_remove_keeps_a_job_at_its_minimum() -> None:
    state = JobState(job="job")
    launching.start_job(state, 2, coordinate_every=1, min_workers=2)
    sizing.set_stragglers(state, StragglersRequest(mode="remove", window=1), now=0.0)
    now, step = train(state, 2, 0.5, 0.0)
    for _ in range(10):
        adjustments.worker_stats(state, WorkerStats("w0", 0, step, 1, 0.1))
        adjustments.worker_stats(state, WorkerStats("w1", 0, step, 1, 0.3))
    sizing.tick(state, now)
    assert not state.pending and state.sizing.decisions[-1]["decision"] == "kept"


def test_bad_sizing_requests_say_what_is_wrong() -> None:
    state = started(2)
    with pytest.raises(sizing.SizingError, match="unknown straggler mode"):
        sizing.set_stragglers(state, StragglersRequest(mode="fast"), now=0.0)
    with pytest.raises(sizing.SizingError, match="unknown autoscale policy"):
        sizing.set_autoscale(state, AutoscaleRequest(policy="magic"), now=0.0)
    with pytest.raises(sizing.SizingError, match="needs a price"):
        sizing.set_autoscale(state, AutoscaleRequest(policy="utility"), now=0.0)
    with pytest.raises(StateError):
        requests.scale(state, "to", size=0)


def test_compute_meter_subtracts_collective_waits_and_skips_micro_batches() -> None:
    meter = ComputeMeter(every_s=1.0)
    meter.step_done(0)
    meter.batch_started(0.0, blocked_s=5.0)
    meter.backward_started(0.5, blocked_s=5.2)  # 0.2 s of the forward waited in a collective
    meter.step_done(0)  # a micro-batch: no optimizer step yet
    meter.batch_started(1.0, blocked_s=5.2)
    meter.backward_started(1.3, blocked_s=5.2)
    meter.step_done(1)
    assert meter.take_due(0.0) is None  # the interval starts
    assert meter.take_due(1.5) == (1, pytest.approx(0.6))


def test_a_job_of_elan_workers_without_a_scale_out_command_cannot_grow_and_says_so() -> None:
    from lightning_elan.master.enrolment import Enrolment
    from lightning_elan.protocol.contract import EnrolRequest

    state = JobState(job="job")
    enrolling.accept_enrolments(state, Enrolment(1, 1, 0.0), coordinate_every=1)
    enrolling.enrol(state, EnrolRequest("host", 1), now=0.0)
    enrolling.housekeeping(state, now=1.0)
    assert state.started and state.world_size == 1
    sizing.set_autoscale(state, AutoscaleRequest(policy="throughput", every=2), now=1.0)
    now, _ = train(state, 3, 1.0, 1.0)
    assert sizing.tick(state, now) == 0
    assert not state.pending and state.sizing.autoscale is None
    assert "no --scale-out-command" in state.sizing.decisions[-1]["reason"]
    sizing.set_autoscale(state, AutoscaleRequest(policy="throughput", every=2, scale_out_command="true"), now=now)
    now, _ = train(state, 3, 1.0, now)
    assert sizing.tick(state, now) == 1  # the server runs the command once; the new `elan worker` enrols
    assert sizing.tick(state, now + 1.0) == 0  # ... and is awaited: the command is not run again meanwhile
    assert sizing.tick(state, now + sizing.SCALE_OUT_WAIT_S + 1.0) == 1  # it never came: ask again
