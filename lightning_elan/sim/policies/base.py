"""What every scheduling policy implements, and helpers they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from lightning_elan.sim.jobmodel import BatchRule

if TYPE_CHECKING:
    from lightning_elan.sim.view import ClusterView, SimulatedJob


class Policy(ABC):
    """Called at every event with the cluster's state; returns the GPU count of every active job (0 = waits)."""

    name: str = ""
    batch_rule: BatchRule = BatchRule.FIXED

    @abstractmethod
    def decide(self, view: ClusterView) -> dict[int, int]: ...

    def next_wakeup(self, view: ClusterView) -> float | None:
        """A time (> view.now) at which the policy wants to decide again even if no job arrives or ends."""
        return None


def keep_running(view: ClusterView) -> dict[int, int]:
    """The allocation that changes nothing."""
    return {job.job_id: job.size for job in view.running}


def static_runtime_s(view: ClusterView, job: SimulatedJob) -> float:
    """Run time of ``job``'s remaining work on its requested GPUs."""
    runtime = view.runtime_s(job, job.spec.num_gpu)
    assert runtime is not None, "a job's request is always feasible"
    return runtime
