"""The discrete-event engine: jobs arrive, a policy sets every job's GPU count at each event, jobs progress.

Events are arrivals, completions and the times a policy asks to be woken (Tiresias' queue demotions, a periodic
allocator's ticks). Between events every running job progresses at its rate, except while it is paused by an
adjustment. GPUs are handed out as numbered devices and checked so none is ever held by two jobs.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_elan.sim.costs import CostModel
from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import BatchRule, JobSpec

if TYPE_CHECKING:
    from lightning_elan.sim.policies.base import Policy

log = logging.getLogger(__name__)

FINISH_TOLERANCE = 1e-9  # fraction of a job's samples left that still counts as done
MAX_EVENTS_AT_ONE_TIME = 10_000


@dataclass
class JobState:
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
    running: list[JobState]
    pending: list[JobState]
    rule: BatchRule
    costs: CostModel

    @property
    def free_gpus(self) -> int:
        return self.total_gpus - sum(job.size for job in self.running)

    def runtime_s(self, job: JobState, gpus: int) -> float | None:
        """Time to finish ``job``'s remaining samples on ``gpus`` GPUs (no pause), None when infeasible."""
        rate = job.spec.rate(gpus, self.rule)
        return None if rate is None else job.remaining / rate


@dataclass
class SimulationResult:
    policy: str
    cost_model: str
    total_gpus: int
    jobs: list[JobState]
    timeline: list[tuple[float, int]]  # (time, GPUs allocated from then on)


def simulate(jobs: Sequence[JobSpec], total_gpus: int, policy: Policy, costs: CostModel) -> SimulationResult:
    """Run ``jobs`` on ``total_gpus`` GPUs under ``policy``; raises :class:`SimulationError` on a broken invariant."""
    run = _Run(jobs, total_gpus, policy, costs)
    run.loop()
    result = SimulationResult(policy.name, costs.name, total_gpus, run.states, run.timeline)
    check_conservation(result)
    return result


class _Run:
    def __init__(self, jobs: Sequence[JobSpec], total_gpus: int, policy: Policy, costs: CostModel) -> None:
        self.total_gpus = total_gpus
        self.policy = policy
        self.costs = costs
        self.states = [JobState(spec, spec.samples) for spec in sorted(jobs, key=lambda j: (j.submit_time, j.job_id))]
        self.arrivals = deque(self.states)
        self.active: list[JobState] = []
        self.owner: list[int | None] = [None] * total_gpus
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
                self.active.append(self.arrivals.popleft())
            self._apply(self.policy.decide(self._view()))
            self.timeline.append((self.now, self.total_gpus - self.owner.count(None)))

    def _view(self) -> ClusterView:
        running = [job for job in self.active if job.size]
        pending = [job for job in self.active if not job.size]
        return ClusterView(self.now, self.total_gpus, running, pending, self.policy.batch_rule, self.costs)

    def _next_event_time(self) -> float:
        candidates = [job.estimated_finish(self.now) for job in self.active if job.size]
        if self.arrivals:
            candidates.append(self.arrivals[0].spec.submit_time)
        wake = self.policy.next_wakeup(self._view()) if self.active else None
        if wake is not None and wake > self.now:
            candidates.append(wake)
        if not candidates:
            waiting = ", ".join(str(job.job_id) for job in self.active[:10])
            raise SimulationError(f"{self.policy.name}: jobs {waiting} wait, nothing runs and nothing will arrive")
        return max(self.now, min(candidates))

    def _advance(self, until: float) -> None:
        for job in self.active:
            if not job.size:
                continue
            busy = max(0.0, until - max(self.now, job.paused_until))
            done = min(job.remaining, job.rate * busy)
            job.remaining -= done
            job.samples_done += done
            job.attained_gpu_s += job.size * (until - self.now)
        self.now = until

    def _finish_done_jobs(self) -> None:
        for job in [job for job in self.active if job.size]:
            if job.remaining <= FINISH_TOLERANCE * job.spec.samples:
                job.samples_done += job.remaining
                job.remaining = 0.0
                job.finish = self.now
                self._release(job, job.size)
                self.active.remove(job)

    def _apply(self, allocation: dict[int, int]) -> None:
        targets = {job.job_id: allocation.get(job.job_id, 0) for job in self.active}
        self._check_allocation(targets)
        by_id = {job.job_id: job for job in self.active}
        shrinking = [job_id for job_id, gpus in targets.items() if gpus < by_id[job_id].size]
        growing = [job_id for job_id, gpus in targets.items() if gpus > by_id[job_id].size]
        for job_id in shrinking + growing:
            self._resize(by_id[job_id], targets[job_id])

    def _check_allocation(self, targets: dict[int, int]) -> None:
        if sum(targets.values()) > self.total_gpus:
            raise SimulationError(f"{self.policy.name} allocated {sum(targets.values())} of {self.total_gpus} GPUs")
        by_id = {job.job_id: job for job in self.active}
        for job_id, gpus in targets.items():
            spec = by_id[job_id].spec
            if gpus and not (spec.min_res <= gpus <= spec.max_res and spec.rate(gpus, self.policy.batch_rule)):
                raise SimulationError(f"{self.policy.name} gave job {job_id} an infeasible {gpus} GPUs")

    def _resize(self, job: JobState, gpus: int) -> None:
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
        job.rate = (job.spec.rate(gpus, self.policy.batch_rule) or 0.0) if gpus else 0.0
        if pause > 0:
            added = max(0.0, self.now + pause - max(self.now, job.paused_until))
            job.paused_until = max(job.paused_until, self.now + pause)
            job.pause_s += added
            job.pause_gpu_s += added * gpus

    def _acquire(self, job: JobState, count: int) -> None:
        free = [gpu for gpu, holder in enumerate(self.owner) if holder is None][:count]
        if len(free) < count:
            raise SimulationError(f"job {job.job_id} needs {count} more GPUs; {len(free)} are free")
        for gpu in free:
            if self.owner[gpu] is not None:
                raise SimulationError(f"GPU {gpu} double-booked: jobs {self.owner[gpu]} and {job.job_id}")
            self.owner[gpu] = job.job_id
            job.gpus.append(gpu)

    def _release(self, job: JobState, count: int) -> None:
        for _ in range(count):
            gpu = job.gpus.pop()
            if self.owner[gpu] != job.job_id:
                raise SimulationError(f"GPU {gpu} released by job {job.job_id} but held by {self.owner[gpu]}")
            self.owner[gpu] = None


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
