"""Saxena et al.'s synthetic workload (004, §IV-A, Table I, §IV-G/I): four job categories, Poisson or bursty arrivals.

Categories (Table I; job lengths on one GPU at the largest batch from §IV-G): 1 resnet50/CIFAR100 (compute bound,
total batch 32–256, 16 min), 2 alexnet/CIFAR100 (communication bound, 16–256, 21 min), 3 vgg11_bn/CIFAR100
(balanced, 16–1024, 41 min), 4 alexnet/Food101 (no elasticity, 128, 27 min). The per-GPU batch limits (32, 64, 128,
64) and per-sample times are this simulator's assumptions; category 1's curve reproduces Table II within 0.04.
A job's submitted batch is uniform in its category's range (the paper's Random-BS); it asks for
``⌈batch / max_per_gpu⌉`` GPUs, may run on ``[⌈min_total / max_per_gpu⌉, kmax]`` (category 4: only its request).

Arrivals: λ = 1 / (mean single-GPU job length). ``high``: Poisson at kmax·λ, ``low``: λ / kmax (the paper's
definitions). ``bursty``: the "very high" / "very low" rates of §IV-G/I, alternating every ``period_min``; the paper
gives no number, so the high rate is ``high_load · GPUs · λ`` (1.4 matches the job counts of its Figs. 7 and 9) and
the low one ``low_load · GPUs · λ``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import BatchRule, BatchSpec, JobSpec, ModelProfile

KMAX = 10


@dataclass(frozen=True)
class Category:
    number: int
    profile: ModelProfile
    min_total: int
    max_total: int
    max_per_gpu: int
    length_min: float
    elastic: bool = True


CATEGORIES: dict[int, Category] = {
    1: Category(1, ModelProfile("resnet50-cifar100", 24_000_000, 0.0026, 0.0169), 32, 256, 32, 16.0),
    2: Category(2, ModelProfile("alexnet-cifar100", 58_000_000, 0.0005), 16, 256, 64, 21.0),
    3: Category(3, ModelProfile("vgg11bn-cifar100", 10_000_000, 0.0010), 16, 1024, 128, 41.0),
    4: Category(4, ModelProfile("alexnet-food101", 58_000_000, 0.0030), 128, 128, 64, 27.0, elastic=False),
}
PATTERNS = ("high", "low", "bursty")


@dataclass(frozen=True)
class ArrivalPattern:
    pattern: str = "bursty"
    minutes: float = 480.0
    period_min: float = 120.0
    high_load: float = 1.4
    low_load: float = 0.1


def saxena_workload(
    gpus: int, arrivals: ArrivalPattern, seed: int, categories: tuple[int, ...] = (1, 2, 3, 4), kmax: int = KMAX,
) -> list[JobSpec]:
    """Jobs submitted over ``arrivals.minutes``; deterministic for a given seed."""
    if arrivals.pattern not in PATTERNS:
        raise SimulationError(f"unknown arrival pattern {arrivals.pattern!r} (one of {', '.join(PATTERNS)})")
    unknown = [number for number in categories if number not in CATEGORIES]
    if unknown or not categories:
        raise SimulationError(f"unknown job categories {unknown} (1–4)")
    if not 0 < arrivals.minutes < math.inf or not 0 < arrivals.period_min < math.inf:
        raise SimulationError(f"the workload's duration and period must be positive minutes, not "
                              f"{arrivals.minutes} and {arrivals.period_min}")
    rng = random.Random(seed)
    base_rate_per_s = 1.0 / (60.0 * sum(CATEGORIES[n].length_min for n in categories) / len(categories))
    jobs: list[JobSpec] = []
    now = 0.0
    while True:
        now += rng.expovariate(_rate_at(now, arrivals, base_rate_per_s, gpus, kmax))
        if now >= arrivals.minutes * 60.0:
            break
        jobs.append(_job(len(jobs), now, CATEGORIES[rng.choice(categories)], rng, kmax))
    if not jobs:
        raise SimulationError(f"no job arrived in {arrivals.minutes:g} minutes ({arrivals.pattern} arrivals, "
                              f"seed {seed})")
    largest = max(jobs, key=lambda job: job.num_gpu)
    if largest.num_gpu > gpus:
        raise SimulationError(f"job {largest.job_id} ({largest.label}) asks for {largest.num_gpu} GPUs; the cluster "
                              f"has {gpus} (Saxena's jobs ask for up to kmax = {kmax})")
    return jobs


def _rate_at(now: float, arrivals: ArrivalPattern, base: float, gpus: int, kmax: int) -> float:
    if arrivals.pattern == "high":
        return kmax * base
    if arrivals.pattern == "low":
        return base / kmax
    high_phase = int(now // (arrivals.period_min * 60.0)) % 2 == 0
    return (arrivals.high_load if high_phase else arrivals.low_load) * gpus * base


def _job(job_id: int, submit: float, category: Category, rng: random.Random, kmax: int) -> JobSpec:
    total = rng.randint(category.min_total, category.max_total)
    request = min(kmax, math.ceil(total / category.max_per_gpu))
    min_res = math.ceil(category.min_total / category.max_per_gpu) if category.elastic else request
    batch = BatchSpec(total, max(1, category.max_per_gpu // 4), category.max_per_gpu, category.min_total,
                      category.max_total)
    job = JobSpec(
        job_id=job_id, submit_time=submit, num_gpu=request, min_res=min(min_res, request),
        max_res=kmax if category.elastic else request, profile=category.profile, batch=batch, samples=0.0,
        label=f"cat{category.number}",
    )
    job.samples = category.length_min * 60.0 * job.reference_rate()
    assert job.rate(request, BatchRule.FIXED) is not None
    return job
