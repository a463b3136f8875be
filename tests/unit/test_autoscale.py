"""Or et al. §4 autoscaling, pure: the scaling efficiency s_{k,d}, the throughput search of Figure 3, the utility
function with bridged steps (Figure 5c) and the marginal utility-versus-cost rule."""

from __future__ import annotations

import json

import pytest

from lightning_elan.sizing.autoscale import (
    SizeDecision,
    ThroughputAutoscaler,
    UtilityAutoscaler,
    UtilityFunction,
    estimate_rate,
    scaling_efficiency,
)


def drive(scaler: ThroughputAutoscaler, curve: dict[int, float], start: int) -> list[int]:
    """Run the search against a fixed throughput curve; the sizes the job visits."""
    current, rates, path = start, {}, [start]
    for _ in range(50):
        rates[current] = curve[current]
        decision = scaler.decide(current, rates)
        if decision is None:
            break
        current = decision.target
        path.append(current)
    return path


# ---------------------------------------------------------------------- s_{k,d} (§4.2.1)


def test_scaling_efficiency_paper_example():
    assert scaling_efficiency({4: 400.0, 5: 500.0}, 4, 1) == pytest.approx(1.0)
    assert scaling_efficiency({4: 400.0, 5: 450.0}, 4, 1) == pytest.approx(0.5)


def test_scaling_efficiency_negative_and_wider_steps():
    assert scaling_efficiency({4: 400.0, 5: 350.0}, 4, 1) == pytest.approx(-0.5)  # throughput dropped
    assert scaling_efficiency({4: 400.0, 8: 700.0}, 4, 4) == pytest.approx(0.75)  # (300 / 4) / 100


@pytest.mark.parametrize(
    ("rates", "k", "d", "match"),
    [({4: 400.0}, 4, 1, "rate at 5"), ({4: 0.0, 5: 1.0}, 4, 1, "positive"), ({4: 1.0}, 0, 4, "k >= 1")],
)
def test_scaling_efficiency_rejects(rates, k, d, match):
    with pytest.raises(ValueError, match=match):
        scaling_efficiency(rates, k, d)


# ---------------------------------------------------------------------- throughput search (§4.1, Figure 3)


def test_first_decision_adds_step_and_keeps_adding_while_it_pays():
    scaler = ThroughputAutoscaler(step=4, threshold=0.1, max_workers=32)
    first = scaler.decide(4, {4: 400.0})
    assert first is not None and first.target == 8
    rates = {4: 400.0, 8: 760.0}  # s_{4,4} = (360 / 4) / 100 = 0.9
    assert scaler.decide(8, rates).target == 12
    assert scaler.evaluations[-1]["efficiency"] == pytest.approx(0.9)


def test_figure3_left_settles_before_the_first_failure():
    curve = {4: 400.0, 8: 760.0, 12: 790.0}  # s_{8,4} = (30 / 4) / 95 = 0.0789 <= 0.1
    scaler = ThroughputAutoscaler(step=4, threshold=0.1)
    assert drive(scaler, curve, 4) == [4, 8, 12, 8]
    assert scaler.settled and scaler.settled_size == 8
    assert scaler.evaluations[-1]["efficiency"] == pytest.approx(7.5 / 95)
    assert scaler.decide(8, {**curve, 16: 5000.0}) is None  # settled: None forever


def test_figure3_right_walks_down_to_the_next_size_without_statistics():
    curve = {8: 800.0, 12: 810.0, 4: 500.0}  # s_{8,4} = 0.025 fails; s_{4,4} = (300 / 4) / 125 = 0.6 passes
    scaler = ThroughputAutoscaler(step=4, threshold=0.1)
    assert drive(scaler, curve, 8) == [8, 12, 4, 8]
    assert scaler.settled_size == 8
    assert [round(e["efficiency"], 4) for e in scaler.evaluations] == [0.025, 0.6]


def test_walk_down_goes_on_until_an_addition_pays_and_stops_at_min():
    curve = {8: 800.0, 12: 810.0, 4: 780.0, 1: 200.0}  # s_{4,4} = (20 / 4) / 195 fails; s_{1,3} = (580/3)/200 passes
    scaler = ThroughputAutoscaler(step=4, threshold=0.1)
    assert drive(scaler, curve, 8) == [8, 12, 4, 1, 4]
    assert scaler.settled_size == 4
    assert scaler.evaluations[-1]["efficiency"] == pytest.approx((580 / 3) / 200)
    flat = {2: 200.0, 3: 201.0, 1: 199.0}  # nothing ever pays: the lower limit
    scaler = ThroughputAutoscaler(step=1, threshold=0.1, min_workers=1)
    assert drive(scaler, flat, 2) == [2, 3, 1]
    assert scaler.settled_size == 1 and "lower limit" in scaler.settle_reason


def test_start_at_upper_limit_first_removes_step():
    curve = {8: 800.0, 4: 420.0}  # s_{4,4} = (380 / 4) / 105 = 0.905: the top size is worth it
    scaler = ThroughputAutoscaler(step=4, threshold=0.1, max_workers=8)
    assert drive(scaler, curve, 8) == [8, 4, 8]
    assert scaler.settled_size == 8


def test_growth_bounded_by_max_workers_uses_the_real_d():
    curve = {6: 600.0, 8: 780.0}  # d = 2: s_{6,2} = (180 / 2) / 100 = 0.9
    scaler = ThroughputAutoscaler(step=4, threshold=0.1, max_workers=8)
    assert drive(scaler, curve, 6) == [6, 8]
    assert scaler.evaluations == [{"k": 6, "d": 2, "efficiency": pytest.approx(0.9), "passed": True}]
    assert scaler.settled_size == 8 and "upper limit" in scaler.settle_reason


def test_single_allowed_size_settles_at_once_and_outside_sizes_are_brought_in():
    scaler = ThroughputAutoscaler(min_workers=3, max_workers=3)
    assert scaler.decide(3, {3: 300.0}) is None and scaler.settled_size == 3
    scaler = ThroughputAutoscaler(min_workers=2, max_workers=4)
    assert scaler.decide(6, {6: 600.0}).target == 4
    assert scaler.decide(4, {6: 600.0, 4: 400.0}).target == 3  # at the limit: the search starts by removing one


def test_known_sizes_are_judged_without_a_move():
    scaler = ThroughputAutoscaler(step=1, threshold=0.1)
    decision = scaler.decide(4, {4: 400.0, 5: 480.0, 6: 490.0})  # s_{4,1} = 0.8 passes; s_{5,1} = 10 / 96 = 0.104
    assert decision.target == 7
    scaler = ThroughputAutoscaler(step=1, threshold=0.1)
    assert scaler.decide(4, {4: 400.0, 5: 480.0, 6: 481.0}).target == 5  # s_{5,1} = 1 / 96 fails: settle at 5
    assert scaler.settled_size == 5


def test_not_measured_yet_waiting_and_partial_grants():
    scaler = ThroughputAutoscaler(step=4)
    assert scaler.decide(4, {}) is None
    assert scaler.decide(4, {4: 400.0}).target == 8
    again = scaler.decide(4, {4: 400.0})  # the move has not happened yet: the same request
    assert again.target == 8 and "waiting" in again.reason
    decision = scaler.decide(6, {4: 400.0, 6: 600.0})  # only 6 came: start over from 6, 4 -> 6 is known
    assert decision.target == 10 and scaler.pending == 10


def test_decision_is_json_and_round_trips_state():
    scaler = ThroughputAutoscaler(step=4, threshold=0.1, max_workers=16)
    scaler.decide(8, {8: 800.0})
    decision = scaler.decide(12, {8: 800.0, 12: 810.0})
    assert isinstance(decision, SizeDecision) and decision.target == 4
    assert decision.reason == "look below 8 workers: try 4; last s_{8,4} = 0.025 vs threshold 0.1"
    payload = json.loads(json.dumps(decision.to_dict()))
    assert payload["inputs"]["threshold"] == 0.1 and payload["inputs"]["rates"] == {"8": 800.0, "12": 810.0}
    restored = ThroughputAutoscaler.from_dict(json.loads(json.dumps(scaler.to_dict())))
    assert restored.to_dict() == scaler.to_dict()
    rates = json.loads(json.dumps({8: 800.0, 12: 810.0, 4: 500.0}))  # sizes as strings, as a state file has them
    assert restored.decide(4, rates).target == 8 and restored.settled_size == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": -0.1}, "threshold"),
        ({"step": 0}, "step"),
        ({"min_workers": 0}, "min_workers"),
        ({"min_workers": 4, "max_workers": 2}, "min_workers .4. must be <= max_workers .2."),
    ],
)
def test_throughput_autoscaler_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThroughputAutoscaler(**kwargs)


# ---------------------------------------------------------------------- rate estimates


def test_estimate_rate_measured_interpolated_and_extrapolated():
    assert estimate_rate({4: 400.0}, 4) == 400.0
    assert estimate_rate({4: 400.0}, 6) == pytest.approx(600.0)  # one point: linear
    assert estimate_rate({4: 400.0}, 2) == pytest.approx(200.0)
    assert estimate_rate({4: 400.0, 8: 600.0}, 6) == pytest.approx(500.0)  # between: linear interpolation
    # above: s_{4,4} = (200 / 4) / 100 = 0.5 -> R_10 = 600 + 2 * 0.5 * 75
    assert estimate_rate({4: 400.0, 8: 600.0}, 10) == pytest.approx(675.0)
    # below: R_2 such that s_{2,2} = 0.5: R_2 = 400 / (1 + 2 * 0.5 / 2)
    assert estimate_rate({4: 400.0, 8: 600.0}, 2) == pytest.approx(400.0 / 1.5)
    assert estimate_rate({4: 400.0, 5: 300.0}, 6) == pytest.approx(300.0)  # a negative s is clamped to 0
    assert estimate_rate({4: 400.0, 5: 600.0}, 6) == pytest.approx(720.0)  # s = 2 is clamped to 1


# ---------------------------------------------------------------------- utility function (§4.2.2, Figure 5)

STEPS = {"steps": [{"deadline_s": 3600, "value": 100}, {"deadline_s": 7200, "value": 40}], "after": 0}


def test_step_utility_bridges_the_gaps_linearly():
    u = UtilityFunction.from_dict({**STEPS, "horizon_s": 10800})
    assert [u.value(t) for t in (0, 3600, 5400, 7200, 9000, 10800, 20000)] == pytest.approx(
        [100, 100, 70, 40, 20, 0, 0]
    )
    cliff = UtilityFunction.from_dict(STEPS)  # no horizon: the last step ends in a cliff
    assert cliff.value(7200) == 40 and cliff.value(7201) == 0


def test_points_utility_and_round_trip():
    u = UtilityFunction.from_dict({"points": [[0, 1000], [1000, 0]]})
    assert u.value(250) == pytest.approx(750.0) and u.value(5000) == 0.0
    again = UtilityFunction.from_dict(json.loads(json.dumps(u.to_dict())))
    assert again.value(250) == pytest.approx(750.0)


def test_utility_from_json_and_yaml_files(tmp_path):
    json_file = tmp_path / "u.json"
    json_file.write_text(json.dumps({**STEPS, "horizon_s": 10800}))
    yaml_file = tmp_path / "u.yaml"
    yaml_file.write_text(
        "steps:\n  - {deadline_s: 3600, value: 100}\n  - {deadline_s: 7200, value: 40}\nhorizon_s: 10800\n"
    )
    for path in (json_file, str(yaml_file)):
        assert UtilityFunction.from_file(path).value(5400) == pytest.approx(70.0)


@pytest.mark.parametrize(
    ("text", "name", "match"),
    [
        ("{not json", "u.json", "not valid JSON"),
        ("steps: [", "u.yaml", "not valid YAML"),
        ('{"steps": [{"deadline_s": 10, "value": 1}, {"deadline_s": 20, "value": 5}]}', "u.json", "must not increase"),
        ('{"steps": [{"deadline_s": 20, "value": 5}, {"deadline_s": 10, "value": 1}]}', "u.json", "increase strictly"),
        ('{"steps": [{"deadline_s": 10}]}', "u.json", "lacks"),
        ('{"points": [[0, 1]], "deadline": 3}', "u.json", "unknown utility keys"),
        ('{"after": 1}', "u.json", "exactly one of"),
        ('{"steps": [{"deadline_s": 10, "value": 5}], "horizon_s": 5}', "u.json", "horizon_s"),
        ("[1, 2]", "u.json", "mapping"),
    ],
)
def test_malformed_utility_file_names_file_and_problem(tmp_path, text, name, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        UtilityFunction.from_file(path)
    assert str(path) in str(info.value)


def test_missing_utility_file():
    with pytest.raises(ValueError, match=r"nowhere\.json: cannot read"):
        UtilityFunction.from_file("/nonexistent/nowhere.json")


# ---------------------------------------------------------------------- utility vs cost (§4.2.2)

LINEAR = UtilityFunction.from_dict({"points": [[0, 1000], [1000, 0]]})  # U(T) = 1000 - T


def test_first_addition_uses_a_linear_estimate_and_says_so():
    scaler = UtilityAutoscaler(price_per_worker_s=0.5, utility=LINEAR)
    # T(4) = 100000 / 400 = 250 s; estimate R_5 = 500 -> T(5) = 200 s: utility +50, cost 0.5*4*250 = 0.5*5*200
    decision = scaler.decide(4, {4: 400.0}, remaining_samples=100_000, elapsed_s=0.0)
    assert decision.target == 5
    assert decision.inputs["estimated"] == [3, 5]
    assert decision.inputs["candidates"][5]["rate"] == pytest.approx(500.0)
    assert decision.inputs["candidates"][5]["utility"] - decision.inputs["candidates"][4]["utility"] == pytest.approx(
        50.0
    )
    assert decision.inputs["candidates"][5]["cost"] == pytest.approx(decision.inputs["candidates"][4]["cost"])
    assert "estimated" in decision.reason
    json.dumps(decision.to_dict())


def test_grows_while_gain_exceeds_cost_and_shrinks_when_cost_exceeds_loss():
    rates = {4: 400.0, 5: 450.0}  # s_{4,1} = 0.5 -> R_6 estimated 450 + 0.5 * 90 = 495
    remaining = 100_000
    t5, t6 = remaining / 450, remaining / 495
    gain = (1000 - t6) - (1000 - t5)  # 20.2
    cheap = UtilityAutoscaler(0.1, LINEAR).decide(5, rates, remaining, 0.0)
    extra = 0.1 * (6 * t6 - 5 * t5)  # 10.1 < 20.2
    assert gain > extra and cheap.target == 6
    assert cheap.inputs["candidates"][6]["rate"] == pytest.approx(495.0)
    dear = UtilityAutoscaler(0.5, LINEAR).decide(5, rates, remaining, 0.0)
    saved = 0.5 * (5 * t5 - 4 * 250)  # 55.6 > utility lost (1000 - 250) - (1000 - t5) = 27.8
    assert saved > (t5 - 250) and dear.target == 4 and "remove 1 worker" in dear.reason
    assert dear.inputs["estimated"] == [6]


def test_step_utility_stops_at_the_highest_tier_and_bridges_to_it():
    steps = UtilityFunction.from_dict({"steps": [{"deadline_s": 3600, "value": 100}], "horizon_s": 7200})
    scaler = UtilityAutoscaler(0.001, steps)
    # T(4) = 3000 s is already in the top step: no utility to gain, the estimate is linear so the cost is equal
    assert scaler.decide(4, {4: 100.0}, remaining_samples=300_000, elapsed_s=0.0) is None
    # T(4) = 5000 s on the bridge: U = 100 * (1 - 1400 / 3600); T(5) = 4000 s: U = 100 * (1 - 400 / 3600)
    decision = scaler.decide(4, {4: 100.0}, remaining_samples=500_000, elapsed_s=0.0)
    assert decision.target == 5
    assert decision.inputs["candidates"][5]["utility"] == pytest.approx(100 * (1 - 400 / 3600))


def test_first_decision_fills_the_horizon_with_t0():
    scaler = UtilityAutoscaler(0.0, UtilityFunction.from_dict(STEPS))
    scaler.decide(4, {4: 100.0}, remaining_samples=900_000, elapsed_s=600.0)  # T_0 = 600 + 9000
    assert scaler.utility.horizon_s == pytest.approx(9600.0)
    assert scaler.utility.value(8400) == pytest.approx(20.0)
    on_track = UtilityAutoscaler(0.0, UtilityFunction.from_dict(STEPS))
    on_track.decide(4, {4: 100.0}, remaining_samples=100_000, elapsed_s=0.0)
    assert on_track.utility.horizon_s == pytest.approx(14400.0)  # twice the last deadline


def test_free_workers_are_added_only_while_throughput_grows():
    scaler = UtilityAutoscaler(0.0, LINEAR)
    assert scaler.decide(5, {4: 400.0, 5: 400.0}, 100_000, 0.0) is None  # s = 0: R_6 estimated at 400, no gain
    assert scaler.decide(5, {4: 400.0, 5: 480.0}, 100_000, 0.0).target == 6


def test_utility_limits_finished_job_and_round_trip():
    scaler = UtilityAutoscaler(0.1, LINEAR, step=2, min_workers=2, max_workers=5)
    assert scaler.decide(4, {4: 400.0}, 0, 100.0) is None  # nothing left to train
    assert scaler.decide(4, {4: 400.0}, 100_000, 0.0).target == 5  # 4 + 2 bounded by max_workers
    assert scaler.decide(7, {7: 700.0}, 100_000, 0.0).target == 5  # outside the limits
    restored = UtilityAutoscaler.from_dict(json.loads(json.dumps(scaler.to_dict())))
    assert restored.to_dict() == scaler.to_dict()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1.0, LINEAR), "price_per_worker_s"),
        ((1.0, {"points": [[0, 1]]}), "UtilityFunction"),
        ((1.0, LINEAR, 0), "step"),
        ((1.0, LINEAR, 1, 3, 2), "min_workers"),
    ],
)
def test_utility_autoscaler_validates(args, match):
    with pytest.raises(ValueError, match=match):
        UtilityAutoscaler(*args)
    with pytest.raises(ValueError, match="remaining_samples"):
        UtilityAutoscaler(1.0, LINEAR).decide(4, {4: 1.0}, -1, 0)
