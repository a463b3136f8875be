"""Load a workload and run it under several policies and cost models: the library entry point of ``elan simulate``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_elan.sim.cluster import ClusterSpec
from lightning_elan.sim.costs import load_cost_model
from lightning_elan.sim.engine import SimulationResult, simulate
from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import TRACE_MODEL_PROFILES, JobSpec, load_profiles
from lightning_elan.sim.metrics import PolicyMetrics, summarise
from lightning_elan.sim.policies import make_policy
from lightning_elan.sim.synthetic import ArrivalPattern, saxena_workload
from lightning_elan.sim.trace import read_tiresias_trace
from lightning_elan.sim.workload import DEFAULT_BOUNDS, ElasticBounds, jobs_from_trace

log = logging.getLogger(__name__)

SYNTHETIC_PREFIX = "saxena:"


@dataclass(frozen=True)
class Run:
    metrics: PolicyMetrics
    result: SimulationResult


def load_jobs(
    trace: str, cluster: ClusterSpec, seed: int = 0, bounds: ElasticBounds = DEFAULT_BOUNDS,
    profiles: str | Path | None = None,
) -> list[JobSpec]:
    """``trace``: a Tiresias CSV, or ``saxena:PATTERN[:MINUTES]`` for the synthetic workload (high, low, bursty)."""
    if trace.startswith(SYNTHETIC_PREFIX):
        if profiles:
            raise SimulationError("--profiles replaces the trace models' curves; Saxena's workload has its own")
        pattern, _, minutes = trace[len(SYNTHETIC_PREFIX):].partition(":")
        try:
            arrivals = ArrivalPattern(pattern, float(minutes)) if minutes else ArrivalPattern(pattern)
        except ValueError:
            raise SimulationError(f"--trace {trace!r}: minutes must be a number") from None
        return saxena_workload(cluster.total_gpus, arrivals, seed)
    model_profiles = {**TRACE_MODEL_PROFILES, **(load_profiles(profiles) if profiles else {})}
    return jobs_from_trace(read_tiresias_trace(trace), cluster.total_gpus, bounds, model_profiles)


def run_policies(
    jobs: Sequence[JobSpec], total_gpus: int, policies: Sequence[str], cost_models: Sequence[str],
    dp_interval_s: float = 0.0,
) -> list[Run]:
    """Every policy under every cost model, on fresh copies of the jobs (rates are cached per job)."""
    runs = []
    for cost_name in cost_models:
        costs = load_cost_model(cost_name)
        for name in policies:
            result = simulate(jobs, total_gpus, make_policy(name, dp_interval_s), costs)
            runs.append(Run(summarise(result), result))
            log.debug("%s/%s: mean JCT %.0f s", name, cost_name, runs[-1].metrics.mean_jct_s)
    return runs
