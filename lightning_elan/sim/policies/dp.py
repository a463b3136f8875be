"""Saxena et al.'s optimizer and autoscaler (004, §III-C/D, Eqs. 4–5, Algorithm 1, Fig. 4).

The optimizer maximises the sum of throughput scaling factors T_j(b_opt(k_j), k_j) (Eq. 3) over every executing job,
each on at least one GPU, by the dynamic program

    P(j, K) = max_{1 ≤ k ≤ kmax} P(j−1, K−k) + T_j(b_opt(k), k)        (Eq. 4, P(0, ·) = 0)

and reads each job's k_j back from the argmax (Eq. 5). The autoscaler keeps the executing jobs and adds waiting jobs
one by one in arrival order until the optimizer reports infeasible; it runs at every arrival/completion or, with
``interval_s``, every Δ seconds. ``dp`` lets the batch follow b_opt(k) (Saxena's method); ``dp-fixed`` is their
baseline, the same optimizer with each job's global batch fixed. A job's k ranges over ``[min_res, max_res]``
(``max_res`` plays kmax); infeasible k (the batch does not fit) are excluded, as the paper's large negative value does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_elan.sim.jobmodel import BatchRule
from lightning_elan.sim.policies.base import Policy, keep_running
from lightning_elan.sim.view import ClusterView, SimulatedJob

Values = Sequence[float | None]  # values[k-1]: scaling factor on k GPUs, None when infeasible


class DynamicProgram:
    """P(j, ·) rows built one job at a time, so jobs can be appended until the problem becomes infeasible."""

    def __init__(self, total_gpus: int) -> None:
        self.total_gpus = total_gpus
        self.rows = [np.zeros(total_gpus + 1)]  # P(0, K) = 0 for every K
        self.choices: list[np.ndarray] = []

    @property
    def best(self) -> float:
        return float(self.rows[-1][self.total_gpus])

    def try_append(self, values: Values) -> bool:
        """Add a job; keep it and return True if every job can still get a GPU count it accepts."""
        previous = self.rows[-1]
        row = np.full(self.total_gpus + 1, -math.inf)
        choice = np.zeros(self.total_gpus + 1, dtype=np.int64)
        for gpus, value in enumerate(values, start=1):
            if value is None or gpus > self.total_gpus:
                continue
            candidate = previous[: self.total_gpus + 1 - gpus] + value
            better = candidate > row[gpus:]
            row[gpus:][better] = candidate[better]
            choice[gpus:][better] = gpus
        if not np.isfinite(row[self.total_gpus]):
            return False
        self.rows.append(row)
        self.choices.append(choice)
        return True

    def allocation(self) -> list[int]:
        """k_j for the jobs appended, in order (Eq. 5, read back from K down)."""
        gpus = self.total_gpus
        counts = []
        for choice in reversed(self.choices):
            counts.append(int(choice[gpus]))
            gpus -= counts[-1]
        return counts[::-1]


def solve(values_per_job: Sequence[Values], total_gpus: int) -> tuple[float, list[int]] | None:
    """Best total value and allocation for all the jobs, or None when infeasible."""
    program = DynamicProgram(total_gpus)
    for values in values_per_job:
        if not program.try_append(values):
            return None
    return program.best, program.allocation()


class SaxenaDp(Policy):
    name = "dp"
    batch_rule = BatchRule.OPTIMAL

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self._next_tick = 0.0

    def decide(self, view: ClusterView) -> dict[int, int]:
        if self.interval_s and view.now < self._next_tick:
            return keep_running(view)
        if self.interval_s:
            self._next_tick = (math.floor(view.now / self.interval_s) + 1) * self.interval_s
        program = DynamicProgram(view.total_gpus)
        executing = [job for job in view.running if program.try_append(self.values(view, job))]
        if len(executing) != len(view.running):
            return keep_running(view)  # cannot happen: they were feasible together and nothing grew
        for job in view.pending:
            if not program.try_append(self.values(view, job)):
                break
            executing.append(job)
        return {job.job_id: gpus for job, gpus in zip(executing, program.allocation(), strict=True)}

    def values(self, view: ClusterView, job: SimulatedJob) -> list[float | None]:
        spec = job.spec
        return [spec.scaling_factor(k, self.batch_rule) if k >= spec.min_res else None
                for k in range(1, spec.max_res + 1)]

    def next_wakeup(self, view: ClusterView) -> float | None:
        if not self.interval_s or not view.pending:
            return None
        return max(self._next_tick, view.now + 1e-9) if self._next_tick > view.now else view.now + self.interval_s


class SaxenaDpFixedBatch(SaxenaDp):
    name = "dp-fixed"
    batch_rule = BatchRule.FIXED
