"""Tiresias' discretised 2D-LAS (Gu et al., NSDI'19) and EDL's Elastic-Tiresias (003, §5.1, Algorithm 1).

Tiresias: a job's priority queue is set by the GPU·seconds it has attained since it last entered queue 0 (queue i
while that service is below ``thresholds[i]``; EDL's configuration: three queues, 500 and 10,000 GPU·s). At every
event jobs are taken in (queue, submission) order and each one that fits on its requested GPUs runs; a running job
that no longer fits is preempted (kept progress, pays the resume pause when it runs again). Starvation: a waiting
job in a lower queue returns to queue 0 once it has waited ``starvation_factor`` times its run time since its last
promotion (the rule of the Tiresias simulator's ``solve_starvation``; 0 turns it off).

Elastic-Tiresias adds Algorithm 1 on top of that plan. Running jobs keep their current size (capped at the request,
at least ``min_res``) in the plan, so a compacted job stays compacted until GPUs are free again.
* Compaction (more than ``compaction_threshold`` jobs wait): for each waiting job in priority order, gather its
  ``min_res`` GPUs from the free ones and then, one at a time, from running jobs outside queue 0 that are above their
  ``min_res``, always from the one losing least normalised throughput; start it if its normalised throughput
  ``S(min_res)/S(1)`` exceeds the sum of the donors' losses (the GPU-efficiency gain of Alg. 1 line 3).
* Expansion (no job waits): expanded jobs first get back their current size, then each free GPU goes to the job
  with the largest relative gain ``(S(p+1) − S(p)) / S(p)`` if that gain is positive and the time it saves exceeds
  the scale-out pause.
S is the rate under Elan's hybrid batch rule.
"""

from __future__ import annotations

import bisect

from lightning_elan.sim.jobmodel import BatchRule
from lightning_elan.sim.policies.base import Policy
from lightning_elan.sim.view import ClusterView, SimulatedJob

DEFAULT_THRESHOLDS = (500.0, 10_000.0)
DEFAULT_STARVATION_FACTOR = 8.0
DEFAULT_COMPACTION_THRESHOLD = 10


class Tiresias(Policy):
    name = "tiresias"

    def __init__(
        self, thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS, starvation_factor: float = DEFAULT_STARVATION_FACTOR
    ) -> None:
        self.thresholds = thresholds
        self.starvation_factor = starvation_factor
        self._service_at_promotion: dict[int, float] = {}

    def queue(self, job: SimulatedJob) -> int:
        service = job.attained_gpu_s - self._service_at_promotion.get(job.job_id, 0.0)
        queue = 0
        for threshold in self.thresholds:
            if service >= threshold:
                queue += 1
        return queue

    def decide(self, view: ClusterView) -> dict[int, int]:
        self._promote_starving(view)
        return self._base_plan(view, self.priority_order(view))

    def _base_plan(self, view: ClusterView, order: list[SimulatedJob]) -> dict[int, int]:
        """Each job in priority order that fits on its base size runs (every base size is at least one GPU)."""
        allocation: dict[int, int] = {}
        free = view.total_gpus
        for job in order:
            if not free:
                break
            size = self.base_size(job)
            if size <= free:
                allocation[job.job_id] = size
                free -= size
        return allocation

    def base_size(self, job: SimulatedJob) -> int:
        return job.spec.num_gpu

    def priority_order(self, view: ClusterView) -> list[SimulatedJob]:
        """Jobs by (queue, submission time, job id): submission order within each queue.

        A waiting job that never ran has no service (it sits in the queue of service 0) and needs no look-up; the
        view's lists are in submission order, so those jobs are merged with the others rather than sorted.
        """
        fresh = [job for job in view.pending if job.last_stop is None]
        others = sorted([*view.running, *_preempted(view)], key=_submission)
        queues: list[list[SimulatedJob]] = [[] for _ in range(len(self.thresholds) + 1)]
        for job in others:
            queues[self.queue(job)].append(job)
        fresh_queue = sum(1 for threshold in self.thresholds if 0.0 >= threshold)
        queues[fresh_queue] = _merge(fresh, queues[fresh_queue])
        return [job for queue in queues for job in queue]

    def next_wakeup(self, view: ClusterView) -> float | None:
        times = [self._demotion_time(view, job) for job in view.running]
        times += [self._promotion_time(job) for job in _preempted(view)]  # the others have no promotion time
        future = [time for time in times if time is not None and time > view.now]
        return min(future, default=None)

    def _demotion_time(self, view: ClusterView, job: SimulatedJob) -> float | None:
        service = job.attained_gpu_s - self._service_at_promotion.get(job.job_id, 0.0)
        above = [threshold for threshold in self.thresholds if threshold > service]
        return view.now + (above[0] - service) / job.size if above else None

    def _promotion_time(self, job: SimulatedJob) -> float | None:
        if not self.starvation_factor or job.last_stop is None or self.queue(job) == 0:
            return None
        run_s = (job.attained_gpu_s - self._service_at_promotion.get(job.job_id, 0.0)) / job.spec.num_gpu
        return job.last_stop + self.starvation_factor * run_s

    def _promote_starving(self, view: ClusterView) -> None:
        for job in _preempted(view):
            promote_at = self._promotion_time(job)
            if promote_at is not None and promote_at <= view.now:
                self._service_at_promotion[job.job_id] = job.attained_gpu_s


def _preempted(view: ClusterView) -> list[SimulatedJob]:
    """Waiting jobs that ran before (only these can have left queue 0 or be promoted back to it)."""
    return [job for job in view.pending if job.last_stop is not None]


def _submission(job: SimulatedJob) -> tuple[float, int]:
    return job.spec.submit_time, job.job_id


def _merge(ordered: list[SimulatedJob], few: list[SimulatedJob]) -> list[SimulatedJob]:
    """Two lists in submission order merged, ``few`` inserted into ``ordered`` by binary search."""
    if not few:
        return ordered
    merged: list[SimulatedJob] = []
    start = 0
    for job in few:
        index = bisect.bisect_left(ordered, _submission(job), lo=start, key=_submission)
        merged.extend(ordered[start:index])
        merged.append(job)
        start = index
    merged.extend(ordered[start:])
    return merged


class ElasticTiresias(Tiresias):
    name = "elastic-tiresias"
    batch_rule = BatchRule.HYBRID

    def __init__(self, compaction_threshold: int = DEFAULT_COMPACTION_THRESHOLD, **tiresias: object) -> None:
        super().__init__(**tiresias)  # type: ignore[arg-type]
        self.compaction_threshold = compaction_threshold

    def base_size(self, job: SimulatedJob) -> int:
        if job.size:
            return max(job.spec.min_res, min(job.size, job.spec.num_gpu))
        return job.spec.num_gpu

    def decide(self, view: ClusterView) -> dict[int, int]:
        self._promote_starving(view)
        order = self.priority_order(view)
        allocation = self._base_plan(view, order)
        waiting = [job for job in order if job.job_id not in allocation]
        if len(waiting) > self.compaction_threshold:
            self._compact(view, allocation, waiting)
        elif not waiting:
            self._expand(view, allocation, order)
        return allocation

    def _normalised(self, view: ClusterView, job: SimulatedJob, gpus: int) -> float:
        if gpus == 0:
            return 0.0
        rate, single = job.spec.rate(gpus, view.rule), job.spec.rate(1, view.rule)
        return 0.0 if rate is None or single is None else rate / single

    def _compact(self, view: ClusterView, allocation: dict[int, int], waiting: list[SimulatedJob]) -> None:
        running = {job.job_id: job for job in view.running + view.pending if job.job_id in allocation}
        queues = {job_id: self.queue(job) for job_id, job in running.items()}  # fixed during one decision
        free = view.total_gpus - sum(allocation.values())
        # GPUs the donors could give up in all: a candidate needing more than free + spare cannot start
        spare = sum(allocation[job_id] - job.spec.min_res for job_id, job in running.items()
                    if queues[job_id] != 0 and allocation[job_id] > job.spec.min_res)
        for candidate in waiting:
            need = candidate.spec.min_res
            if free + spare < need:
                continue
            taken: dict[int, int] = {}
            loss = 0.0
            while free + sum(taken.values()) < need:
                donor = self._cheapest_donor(view, allocation, running, taken, queues)
                if donor is None:
                    break
                size = allocation[donor.job_id] - taken.get(donor.job_id, 0)
                loss += self._normalised(view, donor, size) - self._normalised(view, donor, size - 1)
                taken[donor.job_id] = taken.get(donor.job_id, 0) + 1
            if free + sum(taken.values()) < need or self._normalised(view, candidate, need) <= loss:
                continue
            for job_id, count in taken.items():
                allocation[job_id] -= count
                spare -= count
            free += sum(taken.values()) - need
            allocation[candidate.job_id] = need  # at its min_res: nothing to spare
            running[candidate.job_id] = candidate
            queues[candidate.job_id] = self.queue(candidate)

    def _cheapest_donor(
        self, view: ClusterView, allocation: dict[int, int], running: dict[int, SimulatedJob], taken: dict[int, int],
        queues: dict[int, int],
    ) -> SimulatedJob | None:
        best: tuple[float, int] | None = None
        for job_id, job in running.items():
            size = allocation[job_id] - taken.get(job_id, 0)
            if queues[job_id] == 0 or size <= job.spec.min_res:
                continue
            loss = self._normalised(view, job, size) - self._normalised(view, job, size - 1)
            if best is None or (loss, job_id) < best:
                best = (loss, job_id)
        return None if best is None else running[best[1]]

    def _expand(self, view: ClusterView, allocation: dict[int, int], order: list[SimulatedJob]) -> None:
        by_id = {job.job_id: job for job in view.running + view.pending if job.job_id in allocation}
        free = view.total_gpus - sum(allocation.values())
        for job in order:
            if job.job_id in allocation and job.size > allocation[job.job_id]:
                extra = min(job.size - allocation[job.job_id], free)
                allocation[job.job_id] += extra
                free -= extra
        while free > 0:
            best: tuple[float, int] | None = None
            for job_id, job in by_id.items():
                gain = self._expansion_gain(view, job, allocation[job_id])
                if gain is not None and (best is None or (-gain, job_id) < (-best[0], best[1])):
                    best = (gain, job_id)
            if best is None:
                return
            allocation[best[1]] += 1
            free -= 1

    def _expansion_gain(self, view: ClusterView, job: SimulatedJob, gpus: int) -> float | None:
        if gpus + 1 > job.spec.max_res:
            return None
        now_rate, next_rate = job.spec.rate(gpus, view.rule), job.spec.rate(gpus + 1, view.rule)
        if now_rate is None or next_rate is None or next_rate <= now_rate:
            return None
        if job.size and gpus == job.size:
            saved = job.remaining / now_rate - job.remaining / next_rate
            if saved <= view.costs.resize_pause_s(job.spec.profile.parameters, gpus, gpus + 1):
                return None
        return (next_rate - now_rate) / now_rate
