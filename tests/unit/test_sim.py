"""lightning_elan.sim: the DP against brute force, policy reductions and comparisons, conservation, the CLI."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_elan.cli import main
from lightning_elan.sim import (
    POLICIES,
    SHIPPED_TRACE,
    ArrivalPattern,
    ElasticBounds,
    SimulationError,
    check_conservation,
    jobs_from_trace,
    load_cost_model,
    make_policy,
    read_tiresias_trace,
    run_policies,
    saxena_workload,
    simulate,
    summarise,
)
from lightning_elan.sim.costs import AdjustmentKind
from lightning_elan.sim.jobmodel import BatchRule, BatchSpec, hybrid_batch
from lightning_elan.sim.policies.dp import solve
from lightning_elan.sim.policies.tiresias import ElasticTiresias, Tiresias
from lightning_elan.sim.trace import TraceJob

REPO = Path(__file__).resolve().parents[2]
QUEUEING_CLUSTER = 16  # 4 nodes × 4 GPUs: the shipped trace queues (FIFO mean pending 22 s)
TRACE = read_tiresias_trace(SHIPPED_TRACE)


def trace_jobs(total_gpus: int) -> list:
    return jobs_from_trace(TRACE, total_gpus, ElasticBounds())


def mean_jct(policy: str, total_gpus: int, cost: str) -> float:
    result = simulate(trace_jobs(total_gpus), total_gpus, make_policy(policy), load_cost_model(cost))
    return summarise(result).mean_jct_s


# ---------------------------------------------------------------------- the dynamic program


def brute_force(values: list[list[float | None]], total: int) -> float | None:
    best = None
    for counts in itertools.product(*[range(1, len(row) + 1) for row in values]):
        if sum(counts) > total or any(row[k - 1] is None for row, k in zip(values, counts, strict=True)):
            continue
        value = sum(row[k - 1] for row, k in zip(values, counts, strict=True))  # type: ignore[misc]
        best = value if best is None else max(best, value)
    return best


def test_dp_equals_brute_force_up_to_4_jobs_8_gpus() -> None:
    """Every shape from 1 job × 1 GPU to 4 jobs × 8 GPUs, 6 random instances each; kmax up to 8 (above the cluster's
    size too), a fifth of the (job, k) pairs infeasible."""
    rng = random.Random(15)
    instances = 0
    for jobs, total, _ in itertools.product(range(1, 5), range(1, 9), range(6)):
        kmax = rng.randint(1, 8)
        values = [[None if rng.random() < 0.2 else rng.uniform(0.1, 3.0) for _ in range(kmax)] for _ in range(jobs)]
        expected = brute_force(values, total)
        solved = solve(values, total)
        instances += 1
        if expected is None:
            assert solved is None, values
            continue
        assert solved is not None, values
        best, allocation = solved
        assert best == pytest.approx(expected, rel=1e-12)
        assert sum(allocation) <= total and all(1 <= k <= min(kmax, total) for k in allocation)
        assert sum(row[k - 1] for row, k in zip(values, allocation, strict=True)) == pytest.approx(expected)
    assert instances == 4 * 8 * 6


# ---------------------------------------------------------------------- reductions and hand-computed numbers


@pytest.mark.parametrize("total_gpus", [8, QUEUEING_CLUSTER])
def test_e_fifo_with_min_equal_max_equal_request_is_fifo(total_gpus: int) -> None:
    rigid = ElasticBounds(min_factor=1.0, max_factor=1.0)
    costs = load_cost_model("elan")
    fifo = simulate(jobs_from_trace(TRACE, total_gpus, rigid), total_gpus, make_policy("fifo"), costs)
    elastic = simulate(jobs_from_trace(TRACE, total_gpus, rigid), total_gpus, make_policy("e-fifo"), costs)
    assert [(j.job_id, j.first_start, j.finish) for j in fifo.jobs] == [
        (j.job_id, j.first_start, j.finish) for j in elastic.jobs
    ]
    assert summarise(elastic).adjustments == 0


def fifo_by_hand(total_gpus: int) -> dict[int, tuple[float, float, float]]:
    """FIFO from the CSV alone (none of the simulator's code): a job starts at the first time ≥ its submission and ≥
    its predecessor's start at which the jobs started before it leave num_gpu GPUs free; it then runs for exactly
    `duration`. Returns job_id → (submit, start, finish)."""
    schedule: dict[int, tuple[float, float, float, int]] = {}
    previous_start = 0.0
    lines = SHIPPED_TRACE.read_text().splitlines()
    assert lines[0] == "job_id,num_gpu,submit_time,iterations,model_name,duration,interval"
    for line in lines[1:]:
        job_id, num_gpu, submit, _, _, duration, _ = line.split(",")
        assert all(float(submit) >= earlier for earlier, *_ in schedule.values()), "FIFO order is the file's order"
        earliest = max(float(submit), previous_start)
        for start in sorted({earliest} | {end for _, _, end, _ in schedule.values() if end > earliest}):
            busy = sum(held for _, begin, end, held in schedule.values() if begin <= start < end)
            if busy + int(num_gpu) <= total_gpus:
                break
        schedule[int(job_id)] = (float(submit), start, start + float(duration), int(num_gpu))
        previous_start = start
    return {job_id: (submit, start, end) for job_id, (submit, start, end, _) in schedule.items()}


@pytest.mark.parametrize(("total_gpus", "golden_mean_jct"), [(8, 93_389 / 60), (QUEUEING_CLUSTER, 12_049 / 60)])
def test_fifo_golden_numbers_on_the_shipped_trace(total_gpus: int, golden_mean_jct: float) -> None:
    expected = fifo_by_hand(total_gpus)
    by_hand = sum(finish - submit for submit, _, finish in expected.values())
    assert len(expected) == 60 and by_hand / 60 == pytest.approx(golden_mean_jct, abs=1e-9)
    result = simulate(trace_jobs(total_gpus), total_gpus, make_policy("fifo"), load_cost_model("elan"))
    assert len(result.jobs) == 60
    for job in result.jobs:
        _, start, finish = expected[job.job_id]
        assert job.first_start == pytest.approx(start, abs=1e-6)
        assert job.finish == pytest.approx(finish, abs=1e-6)
    assert summarise(result).mean_jct_s == pytest.approx(golden_mean_jct, abs=1e-6)


# ---------------------------------------------------------------------- conservation on every run


@pytest.mark.parametrize("total_gpus", [8, QUEUEING_CLUSTER, 64])
def test_conservation_for_every_policy_and_cost(total_gpus: int) -> None:
    runs = run_policies(trace_jobs(total_gpus), total_gpus, list(POLICIES), ["elan", "restart", "none"])
    assert len(runs) == 3 * len(POLICIES)
    for run in runs:
        check_conservation(run.result)  # every job's samples done once, times ordered, GPUs within capacity
        assert all(0 <= busy <= total_gpus for _, busy in run.result.timeline)
        assert run.metrics.jobs == len(TRACE) and 0 < run.metrics.gpu_utilisation <= 1
        assert run.metrics.adjustment_pause_s >= 0 and run.metrics.mean_pending_s >= 0


def test_conservation_check_catches_lost_samples() -> None:
    result = simulate(trace_jobs(8), 8, make_policy("fifo"), load_cost_model("elan"))
    result.jobs[3].samples_done *= 0.5
    with pytest.raises(SimulationError, match="samples"):
        check_conservation(result)


# ---------------------------------------------------------------------- elastic against static on the shipped trace


PAIRS = [("fifo", "e-fifo"), ("backfill", "e-bf"), ("tiresias", "elastic-tiresias")]


@pytest.mark.parametrize(("static", "elastic"), PAIRS)
def test_elastic_beats_static_with_elan_cost_and_gains_less_with_restart(static: str, elastic: str) -> None:
    gain = {cost: mean_jct(static, QUEUEING_CLUSTER, cost) - mean_jct(elastic, QUEUEING_CLUSTER, cost)
            for cost in ("elan", "restart")}
    assert gain["elan"] > 0
    assert gain["restart"] < gain["elan"]


def test_dp_with_batch_following_b_opt_beats_fixed_batch_baseline() -> None:
    assert mean_jct("dp", QUEUEING_CLUSTER, "elan") < mean_jct("dp-fixed", QUEUEING_CLUSTER, "elan")


# ---------------------------------------------------------------------- policies on hand-built scenarios


def scenario(*jobs: tuple[int, float, float]) -> list:
    """(num_gpu, submit, duration) resnet50 jobs, rigid (min_res = max_res = num_gpu)."""
    entries = [TraceJob(i, n, s, 1, "resnet50", d, 0) for i, (n, s, d) in enumerate(jobs)]
    return jobs_from_trace(entries, 4, ElasticBounds(1.0, 1.0))


@pytest.mark.parametrize(("policy", "small_job_start"), [("fifo", 150.0), ("backfill", 2.0),
                                                         ("e-fifo", 150.0), ("e-bf", 2.0)])
def test_backfill_lets_a_short_job_pass_a_blocked_head(policy: str, small_job_start: float) -> None:
    jobs = scenario((3, 0, 100), (4, 1, 50), (1, 2, 10))
    result = simulate(jobs, 4, make_policy(policy), load_cost_model("elan"))
    assert {job.job_id: job.first_start for job in result.jobs}[2] == pytest.approx(small_job_start)


def test_tiresias_demotes_after_500_gpu_seconds_and_preempts() -> None:
    jobs = scenario((1, 0, 1000), (1, 600, 100))
    result = simulate(jobs, 1, Tiresias(), load_cost_model("elan"))
    long_job, short_job = result.jobs
    assert short_job.first_start == 600 and short_job.finish == pytest.approx(700)
    assert long_job.preemptions == 1 and long_job.adjustments == 1  # one resume, paying the restart pause
    resume = load_cost_model("elan").resume_pause_s(long_job.spec.profile.parameters)
    assert long_job.finish == pytest.approx(1100 + resume)
    fifo = simulate(scenario((1, 0, 1000), (1, 600, 100)), 1, make_policy("fifo"), load_cost_model("elan"))
    assert fifo.jobs[1].first_start == pytest.approx(1000)


def test_elastic_tiresias_compaction_and_expansion() -> None:
    costs = load_cost_model("elan")
    compacting = summarise(simulate(trace_jobs(12), 12, ElasticTiresias(compaction_threshold=0), costs))
    assert compacting.mean_jct_s < summarise(simulate(trace_jobs(12), 12, Tiresias(), costs)).mean_jct_s
    expanded = summarise(simulate(trace_jobs(64), 64, ElasticTiresias(), costs))
    assert expanded.gpu_utilisation > summarise(simulate(trace_jobs(64), 64, Tiresias(), costs)).gpu_utilisation


# ---------------------------------------------------------------------- job model, costs, synthetic workload


def test_hybrid_batch_keeps_then_scales_the_global_batch() -> None:
    spec = BatchSpec(global_batch=64, min_per_gpu=16, max_per_gpu=64, min_total=16, max_total=512)
    assert [hybrid_batch(spec, k) for k in (1, 2, 4, 8)] == [64, 64, 64, 128]
    assert hybrid_batch(BatchSpec(256, 16, 64, 16, 512), 2) == 128


def test_category_1_curve_matches_saxena_table_2() -> None:
    job = saxena_workload(40, ArrivalPattern("high", 60), seed=1, categories=(1,))[0]
    for per_gpu, factor in [(8, 0.86), (11, 1.06), (16, 1.3), (22, 1.45), (32, 1.66)]:
        assert job._rate_at(2 * per_gpu, 2) / job.reference_rate() == pytest.approx(factor, abs=0.04)


def test_cost_tables_interpolate_the_measured_pauses() -> None:
    elan, restart = load_cost_model("elan"), load_cost_model("restart")
    assert elan.adjust.pause_s(AdjustmentKind.SCALE_OUT, 25_724_938) == pytest.approx(0.54)
    assert restart.adjust.pause_s(AdjustmentKind.SCALE_IN, 11_526_538) == pytest.approx(7.3)
    middle = elan.adjust.pause_s(AdjustmentKind.SCALE_OUT, (11_526_538 + 25_724_938) // 2)
    assert middle == pytest.approx((0.21 + 0.54) / 2, abs=1e-3)
    assert elan.adjust.pause_s(AdjustmentKind.SCALE_OUT, 140_000_000) > 0.54  # extrapolated for VGG-sized models
    assert load_cost_model("none").resize_pause_s(10**8, 2, 4) == 0.0


def test_saxena_workload_is_seeded_and_dp_beats_its_fixed_batch_baseline() -> None:
    pattern = ArrivalPattern("bursty", minutes=120, period_min=30)
    first, again = saxena_workload(40, pattern, seed=3), saxena_workload(40, pattern, seed=3)
    assert [(j.submit_time, j.label, j.batch) for j in first] == [(j.submit_time, j.label, j.batch) for j in again]
    assert {job.label for job in first} == {"cat1", "cat2", "cat3", "cat4"}
    runs = run_policies(first, 40, ["dp", "dp-fixed", "fifo", "e-fifo"], ["elan"], dp_interval_s=60.0)
    jct = {run.metrics.policy: run.metrics.mean_jct_s for run in runs}
    assert jct["dp"] < jct["dp-fixed"] and jct["e-fifo"] < jct["fifo"]
    assert all(job.spec.rate(job.spec.num_gpu, BatchRule.FIXED) for job in runs[0].result.jobs)


# ---------------------------------------------------------------------- the command line


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_simulate_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "out"
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_elan.cli", "simulate", "--trace", str(SHIPPED_TRACE), "--cluster", "4x4",
         "--policy", "fifo,e-fifo", "--adjust-cost", "elan,restart", "--out", str(out), "--no-png"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads((out / "simulate.json").read_text())
    assert [(r["metrics"]["policy"], r["metrics"]["cost_model"]) for r in report["runs"]] == [
        ("fifo", "elan"), ("e-fifo", "elan"), ("fifo", "restart"), ("e-fifo", "restart")]
    assert report["runs"][0]["metrics"]["mean_jct_s"] == pytest.approx(12_049 / 60, abs=1e-6)
    assert "| e-fifo | restart |" in (out / "simulate.md").read_text()
    assert "| fifo | elan |" in completed.stdout


def test_cli_simulate_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(["simulate", "--trace", str(SHIPPED_TRACE), "--cluster", "8", "--policy", "fifo",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert (tmp_path / "simulate.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "missing.csv", "--cluster", "8"], "trace file not found: missing.csv"),
        (["--trace", str(SHIPPED_TRACE), "--cluster", "8", "--policy", "fifo,sjf"], "unknown policy 'sjf'"),
        (["--trace", "BAD", "--cluster", "8"], ":3: malformed line"),
        (["--trace", str(SHIPPED_TRACE), "--cluster", "nope.csv"], "cluster spec not found"),
        (["--trace", str(SHIPPED_TRACE), "--cluster", "4"], "asks for 8 GPUs; the cluster has 4"),
        (["--trace", str(SHIPPED_TRACE), "--cluster", "8", "--adjust-cost", "cheap"], "neither elan, restart"),
    ],
)
def test_cli_simulate_rejects_bad_input(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n0,1,0,6,vgg19,164,30\n"
                   "1,two,30,133,vgg11,147,23\n")
    argv = [str(bad) if arg == "BAD" else arg for arg in argv]
    code, _, err = run_cli(["simulate", *argv], capsys)
    assert code == 2
    assert message in err and err.startswith("elan: error: simulate:")


@pytest.mark.parametrize("policy", ["tiresias", "elastic-tiresias"])
def test_tiresias_priority_order_equals_a_full_sort_at_every_event(policy: str) -> None:
    """The merged priority order (only jobs that ran are looked up) is the plain (queue, submission) sort."""
    tiresias = make_policy(policy)
    fast_order = tiresias.priority_order  # type: ignore[attr-defined]
    checked = []

    def checked_order(view):  # type: ignore[no-untyped-def]
        order = fast_order(view)
        expected = sorted(view.running + view.pending,
                          key=lambda job: (tiresias.queue(job), job.spec.submit_time, job.job_id))  # type: ignore[attr-defined]
        assert [job.job_id for job in order] == [job.job_id for job in expected]
        checked.append(len(order))
        return order

    tiresias.priority_order = checked_order  # type: ignore[attr-defined,method-assign]
    jobs = jobs_from_trace(read_tiresias_trace(SHIPPED_TRACE), 8)
    check_conservation(simulate(jobs, 8, tiresias, load_cost_model("restart")))
    assert max(checked) > 10
