"""Elan's elastic policies (000, §VI-C): Elastic-FIFO and Elastic-Backfill.

Admission: a waiting job starts if its ``min_res`` fits the free GPUs, or if admitting it (every running job
shrinkable to its own ``min_res``) does not raise the estimated mean JCT of the running jobs and this one.
Allocation: every admitted job gets ``min_res``; then GPUs are handed out one at a time to the job with the largest
marginal gain until no job gains, every job is at ``max_res`` or no GPU is left.

Marginal gain of job j going from k to k+1 GPUs (Optimus-style, in seconds of JCT): ``R/T(k) − R/T(k+1)`` with R its
remaining samples and T its rate under Elan's hybrid batch rule. Adjustment pauses enter the gain: the step that takes
a running job past its current size pays its scale-out pause, the steps up to its current size are credited with the
scale-in pause they avoid.

JCT estimates assume rates stay as allocated: a job ends at ``now + pause + R/T``; a job not admitted starts when the
running jobs (ending in estimated order) leave at least its ``min_res`` free, and then runs on ``min_res``.
"""

from __future__ import annotations

import heapq

from lightning_elan.sim.engine import ClusterView, JobState
from lightning_elan.sim.jobmodel import BatchRule
from lightning_elan.sim.policies.base import Policy

BACKFILL_DEPTH = 64  # E-BF looks this far past a blocked head


class ElasticFifo(Policy):
    name = "e-fifo"
    batch_rule = BatchRule.HYBRID
    backfill = False

    def decide(self, view: ClusterView) -> dict[int, int]:
        admitted = list(view.running)
        blocked: JobState | None = None
        for job in view.pending[: BACKFILL_DEPTH + 1] if self.backfill else view.pending:
            if blocked is None and self._admit(view, admitted, job):
                admitted.append(job)
            elif blocked is None:
                if not self.backfill:
                    break
                blocked = job
            elif self._backfill_allowed(view, admitted, blocked, job) and self._admit(view, admitted, job):
                admitted.append(job)
        return allocate(view, admitted)

    def _admit(self, view: ClusterView, admitted: list[JobState], job: JobState) -> bool:
        minimum = sum(other.spec.min_res for other in admitted)
        if minimum + job.spec.min_res > view.total_gpus:
            return False
        held = sum(other.size if other.size else other.spec.min_res for other in admitted)
        if job.spec.min_res <= view.total_gpus - held:
            return True
        return mean_jct_with(view, admitted, job) <= mean_jct_without(view, admitted, job)

    def _backfill_allowed(self, view: ClusterView, admitted: list[JobState], head: JobState, job: JobState) -> bool:
        """E-BF: ``job`` may go ahead of ``head`` if the head could still start at its ``min_res`` by then."""
        minimum = sum(other.spec.min_res for other in admitted)
        if minimum + job.spec.min_res + head.spec.min_res <= view.total_gpus:
            return True
        runtime = view.runtime_s(job, job.spec.min_res)
        return runtime is not None and view.now + runtime <= _shadow_time(view, admitted, head)


class ElasticBackfill(ElasticFifo):
    name = "e-bf"
    backfill = True


def allocate(view: ClusterView, jobs: list[JobState]) -> dict[int, int]:
    """The allocation rule: ``min_res`` each, then one GPU at a time by largest marginal gain."""
    allocation = {job.job_id: job.spec.min_res for job in jobs}
    free = view.total_gpus - sum(allocation.values())
    heap: list[tuple[float, int, int]] = []
    by_id = {job.job_id: job for job in jobs}
    for order, job in enumerate(jobs):
        _push_gain(view, heap, job, allocation[job.job_id], order)
    orders = {job.job_id: order for order, job in enumerate(jobs)}
    while free > 0 and heap:
        negative_gain, _, job_id = heapq.heappop(heap)
        if -negative_gain <= 0:
            break
        allocation[job_id] += 1
        free -= 1
        _push_gain(view, heap, by_id[job_id], allocation[job_id], orders[job_id])
    return allocation


def _push_gain(view: ClusterView, heap: list[tuple[float, int, int]], job: JobState, gpus: int, order: int) -> None:
    gain = marginal_gain(view, job, gpus)
    if gain is not None:
        heapq.heappush(heap, (-gain, order, job.job_id))


def marginal_gain(view: ClusterView, job: JobState, gpus: int) -> float | None:
    """Seconds of JCT saved by giving ``job`` a GPU more than ``gpus``; None when it may not grow."""
    if gpus + 1 > job.spec.max_res:
        return None
    now_s, next_s = view.runtime_s(job, gpus), view.runtime_s(job, gpus + 1)
    if now_s is None or next_s is None:
        return None
    gain = now_s - next_s
    parameters = job.spec.profile.parameters
    if job.size and gpus == job.size:
        gain -= view.costs.resize_pause_s(parameters, gpus, gpus + 1)
    elif job.size and gpus < job.size:
        gain += view.costs.resize_pause_s(parameters, job.size, gpus)
    return gain


def _estimated_ends(view: ClusterView, jobs: list[JobState], allocation: dict[int, int]) -> dict[int, float]:
    ends = {}
    for job in jobs:
        gpus = allocation[job.job_id]
        pause = view.costs.resize_pause_s(job.spec.profile.parameters, job.size, gpus) if job.size else 0.0
        start = max(view.now, job.paused_until) if job.size and gpus == job.size else view.now + pause
        ends[job.job_id] = start + (view.runtime_s(job, gpus) or float("inf"))
    return ends


def mean_jct_with(view: ClusterView, admitted: list[JobState], job: JobState) -> float:
    jobs = [*admitted, job]
    ends = _estimated_ends(view, jobs, allocate(view, jobs))
    return sum(ends[j.job_id] - j.spec.submit_time for j in jobs) / len(jobs)


def mean_jct_without(view: ClusterView, admitted: list[JobState], job: JobState) -> float:
    allocation = allocate(view, admitted)
    ends = _estimated_ends(view, admitted, allocation)
    free = view.total_gpus - sum(allocation.values())
    start = view.now
    for other in sorted(admitted, key=lambda other: ends[other.job_id]):
        if free >= job.spec.min_res:
            break
        free += allocation[other.job_id]
        start = ends[other.job_id]
    own_end = start + (view.runtime_s(job, job.spec.min_res) or float("inf"))
    total = sum(ends[j.job_id] - j.spec.submit_time for j in admitted) + own_end - job.spec.submit_time
    return total / (len(admitted) + 1)


def _shadow_time(view: ClusterView, admitted: list[JobState], head: JobState) -> float:
    """When enough admitted jobs will have ended for ``head`` to fit at its ``min_res``."""
    ends = _estimated_ends(view, admitted, allocate(view, admitted))
    minimum = sum(job.spec.min_res for job in admitted)
    for job in sorted(admitted, key=lambda job: ends[job.job_id]):
        minimum -= job.spec.min_res
        if minimum + head.spec.min_res <= view.total_gpus:
            return ends[job.job_id]
    return float("inf")
