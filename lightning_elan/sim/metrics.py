"""Per-policy summary statistics of a finished simulation."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from lightning_elan.sim.engine import SimulationResult


@dataclass(frozen=True)
class PolicyMetrics:
    policy: str
    cost_model: str
    jobs: int
    mean_jct_s: float
    median_jct_s: float
    p95_jct_s: float
    mean_pending_s: float
    makespan_s: float
    gpu_utilisation: float  # allocated GPU·s / (GPUs × makespan); paused GPUs count as allocated
    adjustments: int  # resizes and resumes after preemption (the first start is not one)
    preemptions: int
    adjustment_pause_s: float  # sum over jobs of the seconds they were paused by adjustments
    adjustment_gpu_s: float  # the same, weighted by the GPUs each paused job held

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``fraction`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def allocated_gpu_seconds(result: SimulationResult, end: float) -> float:
    total = 0.0
    for (time, busy), (next_time, _) in zip(result.timeline, [*result.timeline[1:], (end, 0)], strict=True):
        total += busy * max(0.0, min(next_time, end) - time)
    return total


def summarise(result: SimulationResult) -> PolicyMetrics:
    jobs = result.jobs
    jcts = [job.finish - job.spec.submit_time for job in jobs]  # type: ignore[operator]
    pending = [job.first_start - job.spec.submit_time for job in jobs]  # type: ignore[operator]
    start = min(job.spec.submit_time for job in jobs)
    end = max(job.finish for job in jobs)  # type: ignore[type-var]
    makespan = end - start
    busy = allocated_gpu_seconds(result, end)
    return PolicyMetrics(
        policy=result.policy, cost_model=result.cost_model, jobs=len(jobs),
        mean_jct_s=statistics.fmean(jcts), median_jct_s=statistics.median(jcts), p95_jct_s=percentile(jcts, 0.95),
        mean_pending_s=statistics.fmean(pending), makespan_s=makespan,
        gpu_utilisation=busy / (result.total_gpus * makespan) if makespan > 0 else 0.0,
        adjustments=sum(job.adjustments for job in jobs), preemptions=sum(job.preemptions for job in jobs),
        adjustment_pause_s=sum(job.pause_s for job in jobs), adjustment_gpu_s=sum(job.pause_gpu_s for job in jobs),
    )
