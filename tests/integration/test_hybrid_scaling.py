"""Hybrid scaling end to end: real `elan run` jobs of the float64 probe script with HybridScaling and
ProgressiveLinearLR, gloo on CPU.

Every run is checked for: each sample exactly once per epoch, bit-identical parameters and optimizer state on every
worker at every step, the global batch and the LR the optimizer actually used at every step on every worker (joiners
included) against values computed here from the adjustment steps, and validation at the end of every epoch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    EPOCHS,
    SAMPLES,
    TOLERANCE,
    RunResult,
    assert_each_sample_once,
    assert_ranks_agree,
    assert_states_close,
    check_adjustment_steps,
    digests_by_step,
    elan_cli,
    elan_run,
    read_metrics_csv,
    wait_for_status,
)

pytestmark = pytest.mark.integration

LR0, RAMP = 0.01, 4
# --wait-for-joiners: rank 0 holds a batch until the joiners due at its step are ready, so a scheduled grow lands at
# its step however slowly the joiners start (no effect on the numbers; the checks below hold wherever it lands)
PROBE_ARGS = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--val", "--ramp-steps", str(RAMP),
              "--wait-for-joiners"]


# ---------------------------------------------------------------------- what the job must have done, computed here


@dataclass(frozen=True)
class Step:
    step: int
    epoch: int
    global_batch: int
    size: int  # samples in this global batch (the epoch's last one may be partial)


def expected_steps(initial_batch: int, changes: dict[int, int]) -> list[Step]:
    """The serial-position schedule: each step takes the next global batch; the size changes at the given steps."""
    steps, step, batch = [], 0, initial_batch
    for epoch in range(EPOCHS):
        position = 0
        while position < SAMPLES:
            batch = changes.get(step, batch)
            steps.append(Step(step, epoch, batch, min(batch, SAMPLES - position)))
            position += batch
            step += 1
    return steps


def scheduled_lr(step: int) -> float:
    """The probe's StepLR(step_size=7, gamma=0.5), stepped every optimizer step (multiplying by 0.5 is exact)."""
    lr = LR0
    for _ in range(step // 7):
        lr *= 0.5
    return lr


def ramp_scale(step: int, ramps: list[tuple[int, float]]) -> float:
    """Elan's progressive linear rule: from the multiplier in force at T0 linearly to the target at T0 + RAMP."""
    scale = 1.0
    for start, target in ramps:
        if step <= start:
            break
        origin = scale
        scale = target if step >= start + RAMP else origin + (step - start) / RAMP * (target - origin)
    return scale


def check_steps_and_lr(records: list[dict], expected: list[Step], ramps: list[tuple[int, float]]) -> None:
    """Every worker's recorded [step, epoch, world, global batch, LR used] matches; exact where the ramp is flat."""
    by_step = {item.step: item for item in expected}
    seen = set()
    for record in records:
        for step, epoch, _world, global_batch, lr in record["steps"]:
            seen.add(step)
            assert (epoch, global_batch) == (by_step[step].epoch, by_step[step].global_batch), (record["worker"], step)
            want = scheduled_lr(step) * ramp_scale(step, ramps)
            if ramp_scale(step, ramps) in (1.0, 2.0):
                assert lr == want, f"{record['worker']} step {step}: LR {lr!r} != {want!r}"
            else:
                assert math.isclose(lr, want, rel_tol=1e-12), f"{record['worker']} step {step}: LR {lr} != {want}"
    assert seen == set(by_step), f"steps trained {sorted(seen)} != {sorted(by_step)}"


def check_validation_at_every_epoch_end(records: list[dict], expected: list[Step]) -> None:
    last_step = {item.epoch: item.step for item in expected}
    runs = {tuple(validation) for record in records for validation in record["validations"]}
    assert runs == {(epoch, step + 1) for epoch, step in last_step.items()}, runs


def check_common(run: RunResult, expected: list[Step], schedule: str) -> list[dict]:
    """Exit 0, each sample once per epoch, bit-identical workers at every step, validation at every epoch end, and the
    adjustments where the protocol allows them (in order, at or after their scheduled steps, not at an epoch end)."""
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == len(expected)
    check_validation_at_every_epoch_end(records, expected)
    last_of_epoch = {item.epoch: item.step for item in expected}
    ends = {step + 1 for step in last_of_epoch.values()}
    check_adjustment_steps(run.adjustments(), schedule, coordinate_every=1, epoch_ends=ends)
    return records


# ---------------------------------------------------------------------- weak: grow 2→4 then shrink 4→2


@pytest.mark.solo  # beside another job under `pytest -n` its shrink once came after the job's end (1 adjustment of 2)
def test_weak_scaling_doubles_the_global_batch_and_ramps_the_lr_on_every_rank(tmp_path):
    """Under `weak` a grow 2→4 doubles the global batch (12→24) mid-epoch and the LR reaches exactly 2·lr0 at T0+T on
    every rank, the joiners included; the shrink back halves both. Metrics are logged through Lightning's logger."""
    args = [*PROBE_ARGS, "--batch-size", "6", "--scaling", "weak", "--full-lightning"]
    schedule = "3:add=2,14:remove=2"
    run = elan_run(tmp_path, "weak", 2, args, schedule=schedule)
    assert run.returncode == 0, run.excerpt()
    grow, shrink = run.adjustments()
    t0, t1 = grow["step"], shrink["step"]
    # the joiners are ready at step 3 (--wait-for-joiners) and nothing defers 3 or 14: a precondition, not timing
    assert t0 + RAMP < t1, f"precondition: the joiners must still train at T0+T: grow at {t0}, shrink at {t1}"
    assert (grow["global_batch"], grow["scaling"]["lr_scale"]) == (24, 2.0) and "weak" in grow["scaling"]["reason"]
    assert (shrink["global_batch"], shrink["scaling"]["lr_scale"]) == (12, 1.0)

    expected = expected_steps(12, {t0: 24, t1: 12})
    records = check_common(run, expected, schedule)
    check_steps_and_lr(records, expected, [(t0, 2.0), (t1, 1.0)])
    joiners = [record for record in records if record["worker"] in grow["joiners"]]
    assert len(joiners) == 2
    for record in records:
        if record["worker"] in grow["members"]:
            at_end = [lr for step, *_, lr in record["steps"] if step == t0 + RAMP]
            assert at_end == [2 * scheduled_lr(t0 + RAMP)], (record["worker"], at_end)
    check_logged_metrics(run.out, expected, t0, t1)


def check_logged_metrics(out: Path, expected: list[Step], t0: int, t1: int) -> None:
    """`elan/global_batch`, `elan/local_batch`, `elan/lr_scale`, `elan/world_size` in the CSV logger, every step."""
    (version,) = sorted((out / "logs" / "lightning_logs").iterdir())
    _, rows = read_metrics_csv(version / "metrics.csv")
    logged = {int(row["step"]): row for row in rows if row.get("elan/global_batch")}
    assert sorted(logged) == [item.step for item in expected]
    for item in expected:
        row = logged[item.step]
        world = 4 if t0 <= item.step < t1 else 2
        assert float(row["elan/global_batch"]) == item.global_batch
        assert float(row["elan/world_size"]) == world
        assert float(row["elan/local_batch"]) == math.ceil(item.size / world)  # rank 0 takes the larger share
    lr_rows = {int(row["step"]): float(row["elan/lr_scale"]) for row in rows if row.get("elan/lr_scale")}
    assert lr_rows[t0 + RAMP] == 2.0 and lr_rows[t0 - 1] == 1.0


# ---------------------------------------------------------------------- hybrid: Algorithm 1 with a synthetic profile


def synthetic_profile(path: Path) -> tuple:
    """A ThroughputModel state with t_compute(b) = 2 ms + 1 ms·b at every local batch 1..64 and t_allreduce(n) =
    4 ms + 2 ms·(n−1) at every world size 2..6, so the model's predictions are these numbers exactly."""
    def compute(local: int) -> float:
        return 0.002 + 0.001 * local

    def allreduce(world: int) -> float:
        return 0.0 if world == 1 else 0.004 + 0.002 * (world - 1)

    state = {
        "version": 1, "min_observations": 3, "window": 50, "grad_bytes": None,
        "compute": [[local, 50, compute(local)] for local in range(1, 65)],
        "allreduce": [[world, 50, allreduce(world)] for world in range(2, 7)],
    }
    path.write_text(json.dumps(state))
    return compute, allreduce


def algorithm_1(n_old: int, tbs: int, n_new: int, compute, allreduce) -> int:
    """Elan's Algorithm 1, written out here: the smallest k·TBS (k = 1, 2, 4, … ≤ N'/N) whose best world size among
    1..2·max(N, N') (the smaller on a tie) is at least N'; else weak scaling."""
    def n_opt(batch: int) -> int:
        rates = {n: batch / (compute(math.ceil(batch / n)) + allreduce(n)) for n in range(1, 2 * max(n_old, n_new) + 1)}
        best = max(rates.values())
        return min(n for n, rate in rates.items() if rate >= best * (1 - 1e-9))

    k = 1
    while k * n_old <= n_new:
        if n_opt(k * tbs) >= n_new:
            return k * tbs
        k *= 2
    return round(tbs * n_new / n_old)


def test_hybrid_scaling_chooses_algorithm_1s_global_batch(tmp_path):
    """1→3 workers from a global batch of 12 with a loaded throughput profile: the job trains on with the batch
    Algorithm 1 picks (24 here: neither strong's 12 nor weak's 36), on every rank, with the LR ramped ×2."""
    compute, allreduce = synthetic_profile(tmp_path / "profile.json")
    chosen = algorithm_1(1, 12, 3, compute, allreduce)
    assert chosen == 24, "the profile is meant to make hybrid differ from strong and weak scaling"
    args = [*PROBE_ARGS, "--batch-size", "12", "--scaling", "hybrid", "--profile", str(tmp_path / "profile.json")]
    run = elan_run(tmp_path, "hybrid", 1, args, schedule="3:add=2")
    assert run.returncode == 0, run.excerpt()
    assert run.config()["scaling"] == "hybrid" and run.config()["profile"] == str(tmp_path / "profile.json")
    (grow,) = run.adjustments()
    assert grow["global_batch"] == chosen and grow["scaling"]["local_batch"] == 8
    assert "N_opt(24)=3 >= 3" in grow["scaling"]["reason"], grow["scaling"]
    expected = expected_steps(12, {grow["step"]: chosen})
    records = check_common(run, expected, "3:add=2")
    check_steps_and_lr(records, expected, [(grow["step"], 2.0)])


# ---------------------------------------------------------------------- strong: nothing changes


def test_strong_scaling_changes_nothing(static_run, tmp_path):
    """HybridScaling(policy="strong") + ProgressiveLinearLR through grow and shrink: bit-identical, step by step, to
    the same elastic job without the callbacks, and equal to the static 2-worker run (validation changes nothing)."""
    args = [*PROBE_ARGS, "--batch-size", "6"]
    schedule = "3:add=1,6:remove=1"
    with_callbacks = elan_run(tmp_path, "strong", 2, [*args, "--scaling", "strong"], schedule=schedule)
    without = elan_run(tmp_path, "plain", 2, args, schedule=schedule)
    expected = expected_steps(12, {})
    records = check_common(with_callbacks, expected, schedule)
    check_steps_and_lr(records, expected, [])
    adjustments = with_callbacks.adjustments()
    assert [a["global_batch"] for a in adjustments] == [12, 12]
    assert all(a["scaling"]["lr_scale"] == 1.0 and a["scaling"]["reason"].startswith("strong") for a in adjustments)
    plain_records = check_common(without, expected, schedule)
    # with --wait-for-joiners each job resizes at the first coordination at or after 3 and 6, which nothing defers
    assert [a["step"] for a in adjustments] == [a["step"] for a in without.adjustments()], (
        "precondition: both jobs resize at the same steps, to be compared bit for bit"
    )
    assert digests_by_step(records) == digests_by_step(plain_records)
    assert_states_close(with_callbacks.final_state(), static_run.final_state(), TOLERANCE)
    assert_states_close(without.final_state(), static_run.final_state(), TOLERANCE)


# ---------------------------------------------------------------------- elan status while a hybrid job runs


def test_status_shows_the_fitted_model_and_the_last_decision(live_job):
    """A learning `hybrid` job (throughput model not ready: strong scaling, said so) grows 1→2; `elan status` shows
    the model's throughput table and the decision with its reason, `--json` the same summary."""
    args = ["--samples", "100", "--batch-size", "6", "--epochs", "60", "--step-sleep", "0.03", "--scaling", "hybrid"]
    _, env = live_job("live", 1, args, schedule="4:add=1", coordinate_every=2)
    status = wait_for_status(env, "live", lambda s: (s.get("scaling") or {}).get("last_decision")
                             and s["generation"] == 1)
    summary = status["scaling"]
    assert summary["policy"] == "hybrid" and summary["world_size"] == 2 and summary["global_batch"] == 6
    assert summary["last_decision"]["global_batch"] == 6
    assert "not ready" in summary["last_decision"]["reason"]
    assert [table["global_batch"] for table in summary["throughput"]] == [6, 12]
    assert summary["throughput"][0]["samples_per_s"], "the model learned compute times on one worker"
    human = elan_cli(env, "status", "--job", "live")
    assert "scaling: policy hybrid" in human and "samples/s by workers" in human
    assert "last decision: global batch 6" in human
