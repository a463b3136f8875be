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

from lightning_elan.sim.jobmodel import BatchRule
from lightning_elan.sim.policies.base import Policy
from lightning_elan.sim.view import ClusterView, SimulatedJob

BACKFILL_DEPTH = 64  # E-BF looks this far past a blocked head


class ElasticFifo(Policy):
    name = "e-fifo"
    batch_rule = BatchRule.HYBRID
    backfill = False

    def decide(self, view: ClusterView) -> dict[int, int]:
        plan = _Plan(view, list(view.running))
        blocked: SimulatedJob | None = None
        for job in view.pending[: BACKFILL_DEPTH + 1] if self.backfill else view.pending:
            if blocked is None and self._admit(plan, job):
                plan.add(job)
            elif blocked is None:
                if not self.backfill:
                    break
                blocked = job
            elif self._backfill_allowed(plan, blocked, job) and self._admit(plan, job):
                plan.add(job)
        return dict(plan.allocation())

    def _admit(self, plan: _Plan, job: SimulatedJob) -> bool:
        view = plan.view
        if plan.minimum + job.spec.min_res > view.total_gpus:
            return False
        if job.spec.min_res <= view.total_gpus - plan.held:
            return True
        return mean_jct_with(view, plan.admitted, job, plan.estimates) <= plan.mean_jct_without(job)

    def _backfill_allowed(self, plan: _Plan, head: SimulatedJob, job: SimulatedJob) -> bool:
        """E-BF: ``job`` may go ahead of ``head`` if the head could still start at its ``min_res`` by then."""
        view = plan.view
        if plan.minimum + job.spec.min_res + head.spec.min_res <= view.total_gpus:
            return True
        runtime = view.runtime_s(job, job.spec.min_res)
        return runtime is not None and view.now + runtime <= plan.shadow_time(head)


class _Plan:
    """The jobs admitted so far at one event; what depends only on them is computed once per admission."""

    def __init__(self, view: ClusterView, admitted: list[SimulatedJob]) -> None:
        self.view = view
        self.admitted = admitted
        self.minimum = sum(job.spec.min_res for job in admitted)  # GPUs they need at the least
        self.held = sum(job.size if job.size else job.spec.min_res for job in admitted)
        self._allocation: dict[int, int] | None = None
        self._ends: dict[int, float] | None = None
        self._shadow: dict[int, float] = {}
        self.estimates = _Estimates(view)

    def add(self, job: SimulatedJob) -> None:
        self.admitted.append(job)
        self.minimum += job.spec.min_res
        self.held += job.size if job.size else job.spec.min_res
        self._allocation = self._ends = None
        self._shadow = {}

    def allocation(self) -> dict[int, int]:
        if self._allocation is None:
            self._allocation = allocate(self.view, self.admitted, self.estimates)
        return self._allocation

    def ends(self) -> dict[int, float]:
        if self._ends is None:
            self._ends = _estimated_ends(self.view, self.admitted, self.allocation(), self.estimates)
        return self._ends

    def mean_jct_without(self, job: SimulatedJob) -> float:
        return _mean_jct_without(self.view, self.admitted, job, self.allocation(), self.ends())

    def shadow_time(self, head: SimulatedJob) -> float:
        if head.job_id not in self._shadow:
            self._shadow[head.job_id] = _shadow_time(self.view, self.admitted, head, self.ends())
        return self._shadow[head.job_id]


class ElasticBackfill(ElasticFifo):
    name = "e-bf"
    backfill = True


class _Estimates:
    """Marginal gains and estimated ends per (job, GPUs) at one event: they do not depend on the other jobs."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self._gains: dict[tuple[int, int], float | None] = {}
        self._ends: dict[tuple[int, int], float] = {}

    def gain(self, job: SimulatedJob, gpus: int) -> float | None:
        key = (job.job_id, gpus)
        if key not in self._gains:
            self._gains[key] = marginal_gain(self.view, job, gpus)
        return self._gains[key]

    def end(self, job: SimulatedJob, gpus: int) -> float:
        key = (job.job_id, gpus)
        if key not in self._ends:
            self._ends[key] = _estimated_end(self.view, job, gpus)
        return self._ends[key]


def allocate(view: ClusterView, jobs: list[SimulatedJob], estimates: _Estimates | None = None) -> dict[int, int]:
    """The allocation rule: ``min_res`` each, then one GPU at a time by largest marginal gain."""
    gain_of = (estimates or _Estimates(view)).gain
    allocation = {job.job_id: job.spec.min_res for job in jobs}
    free = view.total_gpus - sum(allocation.values())
    heap: list[tuple[float, int, int]] = []
    for order, job in enumerate(jobs):
        gain = gain_of(job, allocation[job.job_id])
        if gain is not None:
            heap.append((-gain, order, job.job_id))
    heapq.heapify(heap)
    while free > 0 and heap:
        negative_gain, order, job_id = heapq.heappop(heap)
        if -negative_gain <= 0:
            break
        allocation[job_id] += 1
        free -= 1
        gain = gain_of(jobs[order], allocation[job_id])
        if gain is not None:
            heapq.heappush(heap, (-gain, order, job_id))
    return allocation


def marginal_gain(view: ClusterView, job: SimulatedJob, gpus: int) -> float | None:
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


def _estimated_end(view: ClusterView, job: SimulatedJob, gpus: int) -> float:
    pause = view.costs.resize_pause_s(job.spec.profile.parameters, job.size, gpus) if job.size else 0.0
    start = max(view.now, job.paused_until) if job.size and gpus == job.size else view.now + pause
    return start + (view.runtime_s(job, gpus) or float("inf"))


def _estimated_ends(
    view: ClusterView, jobs: list[SimulatedJob], allocation: dict[int, int], estimates: _Estimates | None = None
) -> dict[int, float]:
    if estimates is None:
        return {job.job_id: _estimated_end(view, job, allocation[job.job_id]) for job in jobs}
    return {job.job_id: estimates.end(job, allocation[job.job_id]) for job in jobs}


def mean_jct_with(
    view: ClusterView, admitted: list[SimulatedJob], job: SimulatedJob, estimates: _Estimates | None = None
) -> float:
    jobs = [*admitted, job]
    ends = _estimated_ends(view, jobs, allocate(view, jobs, estimates), estimates)
    return sum(ends[j.job_id] - j.spec.submit_time for j in jobs) / len(jobs)


def mean_jct_without(view: ClusterView, admitted: list[SimulatedJob], job: SimulatedJob) -> float:
    allocation = allocate(view, admitted)
    return _mean_jct_without(view, admitted, job, allocation, _estimated_ends(view, admitted, allocation))


def _mean_jct_without(
    view: ClusterView,
    admitted: list[SimulatedJob],
    job: SimulatedJob,
    allocation: dict[int, int],
    ends: dict[int, float],
) -> float:
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


def _shadow_time(view: ClusterView, admitted: list[SimulatedJob], head: SimulatedJob, ends: dict[int, float]) -> float:
    """When enough admitted jobs will have ended for ``head`` to fit at its ``min_res``."""
    minimum = sum(job.spec.min_res for job in admitted)
    for job in sorted(admitted, key=lambda job: ends[job.job_id]):
        minimum -= job.spec.min_res
        if minimum + head.spec.min_res <= view.total_gpus:
            return ends[job.job_id]
    return float("inf")
