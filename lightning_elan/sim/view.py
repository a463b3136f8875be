"""What a policy sees at an event: each job as it runs and the cluster around it (only the engine writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_elan.sim.costs import CostModel
from lightning_elan.sim.jobmodel import BatchRule, JobSpec

__all__ = ["ClusterView", "SimulatedJob"]


@dataclass
class SimulatedJob:
    """A job as it runs; policies read these fields, only the engine writes them."""

    spec: JobSpec
    remaining: float
    gpus: list[int] = field(default_factory=list)
    rate: float = 0.0
    paused_until: float = 0.0
    first_start: float | None = None
    finish: float | None = None
    last_stop: float | None = None
    attained_gpu_s: float = 0.0
    samples_done: float = 0.0
    adjustments: int = 0
    preemptions: int = 0
    pause_s: float = 0.0
    pause_gpu_s: float = 0.0

    @property
    def job_id(self) -> int:
        return self.spec.job_id

    @property
    def size(self) -> int:
        return len(self.gpus)

    def estimated_finish(self, now: float) -> float:
        """When this job ends if nothing changes (only meaningful while it runs)."""
        return max(now, self.paused_until) + self.remaining / self.rate


@dataclass
class ClusterView:
    """What a policy sees at an event: jobs in submission order and the pause model."""

    now: float
    total_gpus: int
    running: list[SimulatedJob]
    pending: list[SimulatedJob]
    rule: BatchRule
    costs: CostModel

    @property
    def free_gpus(self) -> int:
        return self.total_gpus - sum(job.size for job in self.running)

    def runtime_s(self, job: SimulatedJob, gpus: int) -> float | None:
        """Time to finish ``job``'s remaining samples on ``gpus`` GPUs (no pause), None when infeasible."""
        rate = job.spec.rate(gpus, self.rule)
        return None if rate is None else job.remaining / rate
