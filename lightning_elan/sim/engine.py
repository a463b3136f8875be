"""The discrete-event engine: jobs arrive, a policy sets every job's GPU count at each event, jobs progress.

Events are arrivals, completions and the times a policy asks to be woken (Tiresias' queue demotions, a periodic
allocator's ticks). Between events every running job progresses at its rate, except while it is paused by an
adjustment. GPUs are handed out as numbered devices and checked so none is ever held by two jobs.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_elan.sim.costs import CostModel
from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import JobSpec
from lightning_elan.sim.view import ClusterView, SimulatedJob

if TYPE_CHECKING:
    from lightning_elan.sim.policies.base import Policy

log = logging.getLogger(__name__)

FINISH_TOLERANCE = 1e-9  # fraction of a job's samples left that still counts as done
MAX_EVENTS_AT_ONE_TIME = 10_000


@dataclass
class SimulationResult:
    policy: str
    cost_model: str
    total_gpus: int
    jobs: list[SimulatedJob]
    timeline: list[tuple[float, int]]  # (time, GPUs allocated from then on)


def simulate(jobs: Sequence[JobSpec], total_gpus: int, policy: Policy, costs: CostModel) -> SimulationResult:
    """Run ``jobs`` on ``total_gpus`` GPUs under ``policy``; raises :class:`SimulationError` on a broken invariant."""
    if not jobs:
        raise SimulationError("no jobs to simulate")
    run = _Run(jobs, total_gpus, policy, costs)
    run.loop()
    result = SimulationResult(policy.name, costs.name, total_gpus, run.states, run.timeline)
    check_conservation(result)
    return result


class _Run:
    """The event loop. Bookkeeping is incremental: running and waiting jobs are kept as lists in submission order,
    free GPUs in a min-heap (the lowest-numbered free GPUs are handed out first), so an event costs time in the number
    of running jobs and changed allocations, not in the number of jobs waiting."""

    def __init__(self, jobs: Sequence[JobSpec], total_gpus: int, policy: Policy, costs: CostModel) -> None:
        self.total_gpus = total_gpus
        self.policy = policy
        self.costs = costs
        ordered = sorted(jobs, key=lambda j: (j.submit_time, j.job_id))
        self.states = [SimulatedJob(spec, spec.samples) for spec in ordered]
        self.arrivals = deque(self.states)
        self.rank = {job.job_id: index for index, job in enumerate(self.states)}  # submission order
        self.active: dict[int, SimulatedJob] = {}  # arrived and not finished, in submission order
        self.running = _Ordered(self.rank)
        self.pending = _Ordered(self.rank)
        self.owner: list[int | None] = [None] * total_gpus
        self.free_gpus = list(range(total_gpus))  # a heap
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.now = 0.0

    def loop(self) -> None:
        same_time_events = 0
        while self.arrivals or self.active:
            next_time = self._next_event_time()
            same_time_events = same_time_events + 1 if next_time == self.now else 0
            if same_time_events > MAX_EVENTS_AT_ONE_TIME:
                raise SimulationError(f"{self.policy.name}: no progress at t={self.now:.3f} s")
            self._advance(next_time)
            self._finish_done_jobs()
            while self.arrivals and self.arrivals[0].spec.submit_time <= self.now:
                job = self.arrivals.popleft()
                self.active[job.job_id] = job
                self.pending.add(job)
            self._apply(self.policy.decide(self._view()))
            self.timeline.append((self.now, self.total_gpus - len(self.free_gpus)))

    def _view(self) -> ClusterView:
        return ClusterView(self.now, self.total_gpus, list(self.running.jobs), list(self.pending.jobs),
                           self.policy.batch_rule, self.costs)

    def _next_event_time(self) -> float:
        now = self.now
        candidates = [max(now, job.paused_until) + job.remaining / job.rate for job in self.running.jobs]
        if self.arrivals:
            candidates.append(self.arrivals[0].spec.submit_time)
        wake = self.policy.next_wakeup(self._view()) if self.active else None
        if wake is not None and wake > now:
            candidates.append(wake)
        if not candidates:
            waiting = ", ".join(str(job_id) for job_id in list(self.active)[:10])
            raise SimulationError(f"{self.policy.name}: jobs {waiting} wait, nothing runs and nothing will arrive")
        return max(now, min(candidates))

    def _advance(self, until: float) -> None:
        now = self.now
        elapsed = until - now
        for job in self.running.jobs:
            busy = max(0.0, until - max(now, job.paused_until))
            done = min(job.remaining, job.rate * busy)
            job.remaining -= done
            job.samples_done += done
            job.attained_gpu_s += len(job.gpus) * elapsed
        self.now = until

    def _finish_done_jobs(self) -> None:
        for job in [job for job in self.running.jobs if job.remaining <= FINISH_TOLERANCE * job.spec.samples]:
            job.samples_done += job.remaining
            job.remaining = 0.0
            job.finish = self.now
            self._release(job, job.size)
            self.running.remove(job)
            del self.active[job.job_id]

    def _apply(self, allocation: dict[int, int]) -> None:
        active = self.active
        total = 0
        changed: list[tuple[int, SimulatedJob, int]] = []
        for job_id, gpus in allocation.items():
            job = active.get(job_id)
            if job is None:
                continue
            total += gpus
            if gpus != len(job.gpus):
                changed.append((self.rank[job_id], job, gpus))
        for job in self.running.jobs:
            if job.job_id not in allocation:
                changed.append((self.rank[job.job_id], job, 0))
        if total > self.total_gpus:
            raise SimulationError(f"{self.policy.name} allocated {total} of {self.total_gpus} GPUs")
        for _, job, gpus in changed:
            spec = job.spec
            if gpus and not (spec.min_res <= gpus <= spec.max_res and spec.rate(gpus, self.policy.batch_rule)):
                raise SimulationError(f"{self.policy.name} gave job {job.job_id} an infeasible {gpus} GPUs")
        changed.sort(key=lambda entry: entry[0])
        for _, job, gpus in changed:  # shrink first, so growing jobs find the GPUs freed
            if gpus < len(job.gpus):
                self._resize(job, gpus)
        for _, job, gpus in changed:
            if gpus > len(job.gpus):
                self._resize(job, gpus)

    def _resize(self, job: SimulatedJob, gpus: int) -> None:
        old = job.size
        pause = 0.0
        if gpus == 0:
            job.preemptions += 1
            job.last_stop = self.now
        elif old == 0 and job.first_start is None:
            job.first_start = self.now
        elif old == 0:
            pause = self.costs.resume_pause_s(job.spec.profile.parameters)
            job.adjustments += 1
        else:
            pause = self.costs.resize_pause_s(job.spec.profile.parameters, old, gpus)
            job.adjustments += 1
        if gpus < old:
            self._release(job, old - gpus)
        else:
            self._acquire(job, gpus - old)
        if old == 0:
            self.pending.remove(job)
            self.running.add(job)
        elif gpus == 0:
            self.running.remove(job)
            self.pending.add(job)
        job.rate = (job.spec.rate(gpus, self.policy.batch_rule) or 0.0) if gpus else 0.0
        if pause > 0:
            added = max(0.0, self.now + pause - max(self.now, job.paused_until))
            job.paused_until = max(job.paused_until, self.now + pause)
            job.pause_s += added
            job.pause_gpu_s += added * gpus

    def _acquire(self, job: SimulatedJob, count: int) -> None:
        if len(self.free_gpus) < count:
            raise SimulationError(f"job {job.job_id} needs {count} more GPUs; {len(self.free_gpus)} are free")
        for _ in range(count):
            gpu = heapq.heappop(self.free_gpus)
            if self.owner[gpu] is not None:
                raise SimulationError(f"GPU {gpu} double-booked: jobs {self.owner[gpu]} and {job.job_id}")
            self.owner[gpu] = job.job_id
            job.gpus.append(gpu)

    def _release(self, job: SimulatedJob, count: int) -> None:
        for _ in range(count):
            gpu = job.gpus.pop()
            if self.owner[gpu] != job.job_id:
                raise SimulationError(f"GPU {gpu} released by job {job.job_id} but held by {self.owner[gpu]}")
            self.owner[gpu] = None
            heapq.heappush(self.free_gpus, gpu)


class _Ordered:
    """Jobs kept in submission order (``rank``), with insertion and removal by binary search."""

    def __init__(self, rank: dict[int, int]) -> None:
        self.rank = rank
        self.jobs: list[SimulatedJob] = []
        self.ranks: list[int] = []

    def add(self, job: SimulatedJob) -> None:
        rank = self.rank[job.job_id]
        index = bisect.bisect_left(self.ranks, rank)
        self.ranks.insert(index, rank)
        self.jobs.insert(index, job)

    def remove(self, job: SimulatedJob) -> None:
        index = bisect.bisect_left(self.ranks, self.rank[job.job_id])
        if index == len(self.ranks) or self.jobs[index] is not job:
            raise SimulationError(f"job {job.job_id} is not where the engine keeps it")
        del self.ranks[index]
        del self.jobs[index]


def check_conservation(result: SimulationResult) -> None:
    """Every job finished once with all its samples, times ordered and non-negative, no GPU over-allocated."""
    for job in result.jobs:
        spec = job.spec
        if job.finish is None or job.first_start is None:
            raise SimulationError(f"{result.policy}: job {spec.job_id} never finished")
        if abs(job.samples_done - spec.samples) > 1e-6 * spec.samples or job.remaining != 0.0:
            done, total = job.samples_done, spec.samples
            raise SimulationError(f"{result.policy}: job {spec.job_id} did {done} of {total} samples")
        if not 0.0 <= spec.submit_time <= job.first_start <= job.finish or min(job.pause_s, job.pause_gpu_s) < 0:
            raise SimulationError(f"{result.policy}: job {spec.job_id} has inconsistent times")
        if job.gpus:
            raise SimulationError(f"{result.policy}: job {spec.job_id} finished holding GPUs {job.gpus}")
    times = [time for time, _ in result.timeline]
    if times != sorted(times) or any(not 0 <= busy <= result.total_gpus for _, busy in result.timeline):
        raise SimulationError(f"{result.policy}: utilisation timeline out of order or over capacity")
    # GPU·seconds: what the jobs held (accrued per job) equals what the cluster handed out (the timeline), so no
    # GPU·second was counted for two jobs or for none
    held = sum(job.attained_gpu_s for job in result.jobs)
    end = max(job.finish for job in result.jobs)  # type: ignore[type-var]
    allocated = sum(busy * (min(later, end) - time) for (time, busy), (later, _) in
                    zip(result.timeline, [*result.timeline[1:], (end, 0)], strict=True) if later > time)
    if abs(held - allocated) > 1e-9 * max(1.0, allocated):
        raise SimulationError(f"{result.policy}: jobs held {held} GPU·s but the cluster allocated {allocated}")
