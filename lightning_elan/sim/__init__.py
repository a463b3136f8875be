"""``lightning_elan.sim``: a deterministic discrete-event simulator of a GPU cluster running elastic jobs.

Pure Python (numpy for the dynamic program); no torch, Lightning or processes. ``elan simulate`` is its command line;
docs/simulate.md describes the models and policies.

    from lightning_elan.sim import ClusterSpec, load_jobs, run_policies
    jobs = load_jobs("trace.csv", ClusterSpec(1, 4, 4))
    for run in run_policies(jobs, 16, ["fifo", "e-fifo"], ["elan", "restart"]):
        print(run.metrics)
"""

from lightning_elan.sim.cluster import ClusterSpec, gpus, parse_cluster, read_cluster_spec
from lightning_elan.sim.costs import load_cost_model
from lightning_elan.sim.engine import SimulationResult, check_conservation, simulate
from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import BatchRule, JobSpec
from lightning_elan.sim.metrics import PolicyMetrics, summarise
from lightning_elan.sim.policies import POLICIES, make_policy, parse_policies
from lightning_elan.sim.runner import Run, load_jobs, run_policies
from lightning_elan.sim.synthetic import ArrivalPattern, saxena_workload
from lightning_elan.sim.trace import SHIPPED_TRACE, read_tiresias_trace
from lightning_elan.sim.workload import ElasticBounds, jobs_from_trace

__all__ = [
    "POLICIES", "SHIPPED_TRACE", "ArrivalPattern", "BatchRule", "ClusterSpec", "ElasticBounds", "JobSpec",
    "PolicyMetrics", "Run", "SimulationError", "SimulationResult", "check_conservation", "gpus", "jobs_from_trace",
    "load_cost_model", "load_jobs", "make_policy", "parse_cluster", "parse_policies", "read_cluster_spec",
    "read_tiresias_trace", "run_policies", "saxena_workload", "simulate", "summarise",
]
