"""Non-elastic baselines: FIFO and EASY backfill. Jobs run on exactly their requested GPUs until they finish."""

from __future__ import annotations

from lightning_elan.sim.policies.base import Policy, keep_running, static_runtime_s
from lightning_elan.sim.view import ClusterView


class Fifo(Policy):
    """Start jobs in submission order while the head fits; a job that does not fit blocks those behind it."""

    name = "fifo"

    def decide(self, view: ClusterView) -> dict[int, int]:
        allocation = keep_running(view)
        free = view.free_gpus
        for job in view.pending:
            if job.spec.num_gpu > free:
                break
            allocation[job.job_id] = job.spec.num_gpu
            free -= job.spec.num_gpu
        return allocation


class Backfill(Policy):
    """EASY backfill (Slurm's default): FIFO, and a later job may start now if it does not delay the blocked head.

    The head's reservation (shadow time) is when enough running jobs will have finished, by their exact remaining
    run times; a later job starts if it fits now and ends before the shadow time or uses only GPUs the head will not
    need then.
    """

    name = "backfill"

    def decide(self, view: ClusterView) -> dict[int, int]:
        allocation = keep_running(view)
        free = view.free_gpus
        queue = list(view.pending)
        while queue and queue[0].spec.num_gpu <= free:
            head = queue.pop(0)
            allocation[head.job_id] = head.spec.num_gpu
            free -= head.spec.num_gpu
        if not queue:
            return allocation
        head, later = queue[0], queue[1:]
        shadow, spare = self._reservation(view, allocation, head.spec.num_gpu, free)
        for job in later:
            if not free:
                break  # every job needs at least one GPU
            need = job.spec.num_gpu
            if need > free:
                continue
            if view.now + static_runtime_s(view, job) <= shadow:
                allocation[job.job_id] = need
                free -= need
            elif need <= spare:
                allocation[job.job_id] = need
                free -= need
                spare -= need
        return allocation

    @staticmethod
    def _reservation(view: ClusterView, allocation: dict[int, int], need: int, free: int) -> tuple[float, int]:
        """(shadow time, GPUs free at the shadow time beyond the head's need)."""
        ends = sorted(
            (job.estimated_finish(view.now), job.size) for job in view.running if allocation.get(job.job_id)
        )
        available = free
        for end, size in ends:
            available += size
            if available >= need:
                return end, available - need
        return float("inf"), 0
