"""lightning_elan.sim against what issue 15 asks of it, beyond tests/unit/test_sim.py: FIFO worked out by hand, E-FIFO's
reduction to FIFO on more clusters, cost models and Saxena's workload, the DP policy against brute force on real
jobs, conservation checks catching broken policies, a resize pause charged exactly, why Elastic-Tiresias gains little
on the shipped trace, measured throughput tables, and the committed results reproducing."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import pytest

from lightning_elan.sim import (
    POLICIES,
    SHIPPED_TRACE,
    ArrivalPattern,
    ElasticBounds,
    SimulationError,
    check_conservation,
    gpus,
    jobs_from_trace,
    load_cost_model,
    load_jobs,
    make_policy,
    read_tiresias_trace,
    run_policies,
    saxena_workload,
    simulate,
    summarise,
)
from lightning_elan.sim.engine import ClusterView
from lightning_elan.sim.jobmodel import TRACE_MODEL_PROFILES, BatchRule, ModelProfile, load_profiles
from lightning_elan.sim.policies.base import Policy
from lightning_elan.sim.policies.dp import SaxenaDp, SaxenaDpFixedBatch
from lightning_elan.sim.policies.tiresias import ElasticTiresias, Tiresias
from lightning_elan.sim.trace import TraceJob

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "simulate"
TRACE = read_tiresias_trace(SHIPPED_TRACE)
RIGID = ElasticBounds(min_factor=1.0, max_factor=1.0)


# ---------------------------------------------------------------------- FIFO by hand

# Worked out on paper from the first lines of tiresias_60_job.csv (job_id, num_gpu, submit_time, duration):
#   0: 1 GPU @0 164 s; 1: 8 @30 147 s; 2: 2 @53 127 s; 3: 1 @79 121 s; 4: 4 @99 121 s; 5: 8 @132 138 s;
#   6: 1 @176 121 s.
# 8 GPUs: 0 runs 0–164. 1 needs all 8: starts when 0 ends, 164–311. 2 waits behind 1 (FIFO), 311–438; 3 and 4 fit
# beside it (2+1+4 = 7), 311–432 each. 5 needs 8: after 2 ends, 438–576.
# 16 GPUs: 0 0–164; 1 30–177 (1+8 = 9 busy); 2 53–180; 3 79–200; 4 99–220 (16 busy). 5 needs 8: at 164 only 1 GPU
# frees (15 busy), at 177 job 1's 8 free (7 busy): 177–315. 6 (submitted 176) fits then too (15 busy): 177–298.
FIFO_BY_HAND = {
    8: {0: (0, 164), 1: (164, 311), 2: (311, 438), 3: (311, 432), 4: (311, 432), 5: (438, 576)},
    16: {0: (0, 164), 1: (30, 177), 2: (53, 180), 3: (79, 200), 4: (99, 220), 5: (177, 315), 6: (177, 298)},
}


@pytest.mark.parametrize("total_gpus", sorted(FIFO_BY_HAND))
def test_fifo_first_jobs_as_worked_out_by_hand(total_gpus: int) -> None:
    result = simulate(jobs_from_trace(TRACE, total_gpus), total_gpus, make_policy("fifo"), load_cost_model("elan"))
    times = {job.job_id: (job.first_start, job.finish) for job in result.jobs}
    for job_id, (start, finish) in FIFO_BY_HAND[total_gpus].items():
        assert times[job_id] == pytest.approx((start, finish), abs=1e-9), job_id


# ---------------------------------------------------------------------- E-FIFO with min_res = max_res = num_gpu


@pytest.mark.parametrize("total_gpus", [8, 10, 12, 16, 24, 32, 64])
@pytest.mark.parametrize("cost", ["elan", "restart", "none"])
def test_rigid_e_fifo_is_fifo_on_the_trace(total_gpus: int, cost: str) -> None:
    costs = load_cost_model(cost)
    fifo = simulate(jobs_from_trace(TRACE, total_gpus, RIGID), total_gpus, make_policy("fifo"), costs)
    elastic = simulate(jobs_from_trace(TRACE, total_gpus, RIGID), total_gpus, make_policy("e-fifo"), costs)
    assert [(j.job_id, j.first_start, j.finish, j.adjustments) for j in fifo.jobs] == [
        (j.job_id, j.first_start, j.finish, j.adjustments) for j in elastic.jobs]
    assert fifo.timeline == elastic.timeline
    assert summarise(fifo) == dataclasses.replace(summarise(elastic), policy="fifo")


def test_rigid_e_fifo_is_fifo_on_saxenas_workload() -> None:
    jobs = saxena_workload(40, ArrivalPattern("bursty", minutes=180, period_min=60), seed=7)
    rigid = [dataclasses.replace(job, min_res=job.num_gpu, max_res=job.num_gpu) for job in jobs]
    costs = load_cost_model("elan")
    fifo, elastic = (simulate(rigid, 40, make_policy(name), costs) for name in ("fifo", "e-fifo"))
    assert len(jobs) > 100 and summarise(fifo).mean_pending_s > 0  # it queues
    assert [(j.first_start, j.finish) for j in fifo.jobs] == [(j.first_start, j.finish) for j in elastic.jobs]
    assert summarise(elastic).adjustments == 0


# ---------------------------------------------------------------------- the DP policy on real jobs


def best_by_brute_force(values: list[list[float | None]], total: int) -> float | None:
    best = None
    for counts in itertools.product(*[range(1, len(row) + 1) for row in values]):
        if sum(counts) <= total and all(row[k - 1] is not None for row, k in zip(values, counts, strict=True)):
            value = sum(row[k - 1] for row, k in zip(values, counts, strict=True))  # type: ignore[misc]
            best = value if best is None else max(best, value)
    return best


@pytest.mark.parametrize("policy_class", [SaxenaDp, SaxenaDpFixedBatch])
def test_dp_policy_decisions_equal_brute_force_up_to_4_jobs_8_gpus(policy_class: type[SaxenaDp]) -> None:
    """At every event of random small workloads (≤ 4 jobs, ≤ 8 GPUs, Saxena's job categories with their real
    scaling factors), the allocation the policy returns reaches the brute-force optimum over the jobs it runs, and
    the first job it leaves waiting could not have been added (Saxena's autoscaler adds jobs until infeasible)."""
    rng = random.Random(1504)
    decisions = 0
    for instance in range(40):
        total = rng.randint(2, 8)
        pool = saxena_workload(40, ArrivalPattern("high", minutes=240), seed=instance)
        jobs = [job for job in pool if job.num_gpu <= total][: rng.randint(1, 4)]
        for job in jobs:
            job.max_res = min(job.max_res, total)
        policy = policy_class()
        decide = policy.decide

        def checked(view: ClusterView, decide=decide, policy=policy, total=total) -> dict[int, int]:  # type: ignore[no-untyped-def]
            nonlocal decisions
            allocation = decide(view)
            jobs_now = view.running + view.pending
            chosen = [job for job in jobs_now if job.job_id in allocation]
            values = [policy.values(view, job) for job in chosen]
            got = sum(values[i][allocation[job.job_id] - 1] for i, job in enumerate(chosen))  # type: ignore[misc]
            assert sum(allocation.values()) <= total
            assert got == pytest.approx(best_by_brute_force(values, total), rel=1e-12)
            left = [job for job in view.pending if job.job_id not in allocation]
            if left:
                assert best_by_brute_force([*values, policy.values(view, left[0])], total) is None
            decisions += 1
            return allocation

        policy.decide = checked  # type: ignore[method-assign]
        simulate(jobs, total, policy, load_cost_model("elan"))
    assert decisions > 100


# ---------------------------------------------------------------------- conservation catches broken policies


class Greedy(Policy):
    """Gives every active job its request, whether or not it fits."""

    name = "greedy"

    def decide(self, view: ClusterView) -> dict[int, int]:
        return {job.job_id: job.spec.num_gpu for job in view.running + view.pending}


class Oversize(Policy):
    """Runs jobs one at a time on one GPU more than their max_res."""

    name = "oversize"

    def decide(self, view: ClusterView) -> dict[int, int]:
        job = (view.running + view.pending)[0]
        return {job.job_id: job.spec.max_res + 1}


class Idle(Policy):
    """Never starts anything."""

    name = "idle"

    def decide(self, view: ClusterView) -> dict[int, int]:
        return {}


@pytest.mark.parametrize(("policy", "message"), [(Greedy(), "allocated"), (Oversize(), "infeasible"),
                                                  (Idle(), "nothing runs and nothing will arrive")])
def test_broken_policies_are_caught(policy: Policy, message: str) -> None:
    with pytest.raises(SimulationError, match=message):
        simulate(jobs_from_trace(TRACE, 16), 16, policy, load_cost_model("elan"))


@pytest.mark.parametrize("tamper", ["samples", "gpu_seconds", "times", "gpus"])
def test_conservation_check_catches_each_broken_invariant(tamper: str) -> None:
    result = simulate(jobs_from_trace(TRACE, 8), 8, make_policy("e-fifo"), load_cost_model("elan"))
    check_conservation(result)
    job = result.jobs[5]
    if tamper == "samples":
        job.samples_done += 0.01 * job.spec.samples  # a sample done twice
    elif tamper == "gpu_seconds":
        job.attained_gpu_s += 1.0  # a GPU·second counted for a job the cluster did not give it
    elif tamper == "times":
        job.first_start = job.spec.submit_time - 1.0
    else:
        job.gpus = [0]
    with pytest.raises(SimulationError):
        check_conservation(result)


# ---------------------------------------------------------------------- a resize pays exactly the measured pause


@pytest.mark.parametrize("cost", ["elan", "restart", "none"])
def test_a_scale_out_pauses_the_job_for_the_measured_pause_and_it_ends_when_its_samples_are_done(cost: str) -> None:
    """Two resnet50 jobs on 2 GPUs, each may use 1–2. E-FIFO runs both on one GPU; when the short one ends at 100 s
    the long one scales out to 2 GPUs, pays one scale-out pause, then finishes its remaining samples at the 2-GPU
    rate."""
    trace = [TraceJob(0, 1, 0.0, 1, "resnet50", 1000.0, 0), TraceJob(1, 1, 0.0, 1, "resnet50", 100.0, 0)]
    jobs = jobs_from_trace(trace, 2, ElasticBounds(min_factor=1.0, max_factor=2.0))
    costs = load_cost_model(cost)
    result = simulate(jobs, 2, make_policy("e-fifo"), costs)
    long_job, short_job = sorted(result.jobs, key=lambda job: job.job_id)
    spec = long_job.spec
    one, two = spec.rate(1, BatchRule.HYBRID), spec.rate(2, BatchRule.HYBRID)
    assert one is not None and two is not None and two > one
    pause = costs.resize_pause_s(spec.profile.parameters, 1, 2)
    assert pause == {"elan": pytest.approx(0.54, abs=0.01), "restart": pytest.approx(9.0, abs=0.1), "none": 0.0}[cost]
    assert short_job.finish == pytest.approx(100.0)
    assert long_job.adjustments == 1 and long_job.pause_s == pytest.approx(pause)
    assert long_job.finish == pytest.approx(100.0 + pause + (spec.samples - 100.0 * one) / two, rel=1e-12)
    assert long_job.samples_done == pytest.approx(spec.samples, rel=1e-12)


# ---------------------------------------------------------------------- Elastic-Tiresias on the shipped trace


class CountingElasticTiresias(ElasticTiresias):
    """Counts decisions with more than N jobs waiting and those where compaction changed the plan."""

    def __init__(self, compaction_threshold: int = 10) -> None:
        super().__init__(compaction_threshold=compaction_threshold)
        self.most_waiting = 0
        self.compactions = 0

    def decide(self, view: ClusterView) -> dict[int, int]:
        allocation = super().decide(view)
        self.most_waiting = max(self.most_waiting, len(view.running) + len(view.pending) - len(allocation))
        return allocation

    def _compact(self, view, allocation, waiting) -> None:  # type: ignore[no-untyped-def]
        before = dict(allocation)
        super()._compact(view, allocation, waiting)
        self.compactions += allocation != before


def elastic_tiresias_run(total_gpus: int, threshold: int = 10, cost: str = "elan"):  # type: ignore[no-untyped-def]
    policy = CountingElasticTiresias(threshold)
    metrics = summarise(simulate(jobs_from_trace(TRACE, total_gpus), total_gpus, policy, load_cost_model(cost)))
    tiresias = summarise(simulate(jobs_from_trace(TRACE, total_gpus), total_gpus, Tiresias(), load_cost_model(cost)))
    return policy, metrics, tiresias


def test_elastic_tiresias_gain_at_16_gpus_is_expansion_only() -> None:
    """docs/simulate.md: at 16 GPUs never more than 5 jobs wait, so with N = 10 compaction never runs; the gain
    (−4.5 % mean JCT with elan's pauses) comes from expanding jobs onto idle GPUs, and the restart pause erases it."""
    policy, elastic, tiresias = elastic_tiresias_run(16)
    assert policy.most_waiting == 5 and policy.compactions == 0
    assert elastic.adjustments - elastic.preemptions > 20  # resizes, beyond resumes after preemption
    assert elastic.mean_jct_s / tiresias.mean_jct_s - 1 == pytest.approx(-0.045, abs=0.002)
    assert elastic.gpu_utilisation > tiresias.gpu_utilisation + 0.05
    _, with_restart, _ = elastic_tiresias_run(16, cost="restart")
    assert with_restart.mean_jct_s > tiresias.mean_jct_s  # +0.8 %: the gain is smaller than the pauses it costs


def test_elastic_tiresias_at_8_gpus_never_resizes() -> None:
    """docs/simulate.md: at 8 GPUs more than 10 jobs often wait, but compaction finds no donor (Alg. 1 takes GPUs only
    from running jobs outside queue 0, and 2D-LAS already gives the GPUs to queue-0 jobs first), and expansion needs an
    empty queue: every adjustment is a resume after preemption, none a resize."""
    policy, elastic, tiresias = elastic_tiresias_run(8)
    assert policy.most_waiting > 10
    assert elastic.adjustments == elastic.preemptions
    assert elastic.mean_jct_s == pytest.approx(tiresias.mean_jct_s, rel=0.01)


@pytest.mark.parametrize(("total_gpus", "gain_at_n0"), [(8, -0.208), (12, -0.507), (16, -0.258)])
def test_elastic_tiresias_gains_once_compaction_triggers(total_gpus: int, gain_at_n0: float) -> None:
    """The threshold, not the mechanism, limits the gain on a 60-job trace: with N = 0 compaction runs and
    Elastic-Tiresias cuts Tiresias' mean JCT by 21–51 % (the sweep in docs/simulate.md)."""
    policy, elastic, tiresias = elastic_tiresias_run(total_gpus, threshold=0)
    assert policy.compactions > 0
    assert elastic.mean_jct_s / tiresias.mean_jct_s - 1 == pytest.approx(gain_at_n0, abs=0.002)


# ---------------------------------------------------------------------- measured throughput tables


def test_measured_rates_are_interpolated_and_not_extrapolated_upwards() -> None:
    profile = ModelProfile("m", 10_000_000, 0.0, rates=((1, 100.0), (2, 180.0), (4, 300.0)))
    assert [profile.measured_rate(k) for k in (1, 2, 3, 4, 8)] == [100.0, 180.0, 240.0, 300.0, 300.0]
    assert ModelProfile("m", 1, 0.0, rates=((2, 180.0),)).measured_rate(1) == 90.0


def test_an_elan_profile_result_drives_the_simulation(tmp_path: Path) -> None:
    """A profile JSON may hold measured samples/s per GPU count (the ``rates`` of an ``elan profile`` result, other
    keys ignored). A model measured not to scale is never grown by E-FIFO; one measured to scale is."""
    path = tmp_path / "profiles.json"
    flat = {"rates": {"1": 50.0, "2": 50.0, "4": 50.0, "8": 50.0}, "best": 1, "complete": True}
    scaling = {"rates": {"1": 60, "2": 118, "4": 230, "8": 440}}
    path.write_text(json.dumps({"vgg19": {"parameters": 143_700_000, **flat},
                                "vgg16": {"parameters": 138_400_000, **scaling}}))
    profiles = load_profiles(path)
    assert profiles["vgg16"].measured_rate(3) == pytest.approx(174.0)
    jobs = jobs_from_trace(TRACE, 16, profiles={**TRACE_MODEL_PROFILES, **profiles})
    result = simulate(jobs, 16, make_policy("e-fifo"), load_cost_model("elan"))
    check_conservation(result)
    sizes = {model: [job for job in result.jobs if job.spec.label == model] for model in ("vgg19", "vgg16")}
    assert all(job.adjustments == 0 for job in sizes["vgg19"])  # more GPUs never help it
    assert any(job.adjustments > 0 for job in sizes["vgg16"])
    fifo = simulate(jobs, 16, make_policy("fifo"), load_cost_model("elan"))
    assert all(job.finish - job.first_start == pytest.approx(entry.duration)  # type: ignore[operator]
               for job, entry in zip(sorted(fifo.jobs, key=lambda j: j.job_id), TRACE, strict=True))


# ---------------------------------------------------------------------- the committed results reproduce
def assert_same_metrics(got: dict[str, object], want: dict[str, object], rel: float) -> None:
    """Same keys; numbers equal within ``rel``, everything else (policy and cost-model names) exactly.

    (pytest 9's ``approx`` refuses a mapping that holds strings, so the two kinds are compared apart.)
    """
    assert got.keys() == want.keys()
    for key, expected in want.items():
        if isinstance(expected, (int, float)) and not isinstance(expected, bool):
            assert got[key] == pytest.approx(expected, rel=rel), key
        else:
            assert got[key] == expected, key




@pytest.mark.parametrize("total_gpus", [8, 16])
def test_committed_trace_results_reproduce(total_gpus: int) -> None:
    """bench/results/simulate/trace-60job-{8,16}gpu (the numbers docs/simulate.md quotes) are what the simulator
    computes now: every run's metrics and every job's times."""
    report = json.loads((RESULTS / f"trace-60job-{total_gpus}gpu" / "simulate.json").read_text())
    setup = report["setup"]
    assert setup["jobs"] == 60 and setup["trace"].endswith("tiresias_60_job.csv")
    costs = setup["adjust_cost"].split(",")
    runs = run_policies(jobs_from_trace(TRACE, total_gpus), total_gpus, list(POLICIES), costs)
    assert len(runs) == len(report["runs"]) == len(POLICIES) * len(costs)
    for run, saved in zip(runs, report["runs"], strict=True):
        assert_same_metrics(run.metrics.as_dict(), saved["metrics"], rel=1e-9)
        finishes = {job.job_id: job.finish for job in run.result.jobs}
        assert all(math.isclose(finishes[job["job_id"]], job["finish_s"], rel_tol=1e-9) for job in saved["jobs"])


def test_committed_40_gpu_saxena_results_reproduce() -> None:
    """bench/results/simulate/saxena-bursty-40gpu, `elan` cost: 774 jobs, all eight policies (about 5 s)."""
    report = json.loads((RESULTS / "saxena-bursty-40gpu" / "simulate.json").read_text())
    assert report["setup"]["trace"] == "saxena:bursty:720" and report["setup"]["seed"] == 0
    saved = [run["metrics"] for run in report["runs"] if run["metrics"]["cost_model"] == "elan"]
    jobs = load_jobs("saxena:bursty:720", gpus(40), seed=0)
    assert len(jobs) == report["setup"]["jobs"] == 774
    runs = run_policies(jobs, 40, [metrics["policy"] for metrics in saved], ["elan"])
    assert len(runs) == len(saved)
    for run, metrics in zip(runs, saved, strict=True):
        assert_same_metrics(run.metrics.as_dict(), metrics, rel=1e-9)
