"""Turn a Tiresias trace into simulated jobs: batch, elastic bounds and work in samples.

* Global batch as submitted: ``PER_GPU_BATCH · num_gpu``; per-GPU bounds ``[MIN_PER_GPU, MAX_PER_GPU]``.
* ``min_res = max(1, ⌈min_factor · num_gpu⌉)``, ``max_res = min(cluster GPUs, ⌈max_factor · num_gpu⌉)`` with
  ``min_factor = 0.5`` (EDL's r = 0.5 quality-of-service floor) and ``max_factor = 2`` by default.
* Work: ``samples = duration · rate(num_gpu)`` with the submitted batch, so a job run statically on its requested
  GPUs takes exactly the trace's ``duration`` (the trace's ``iterations`` field is not used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.jobmodel import TRACE_MODEL_PROFILES, BatchRule, BatchSpec, JobSpec, ModelProfile
from lightning_elan.sim.trace import TraceJob

PER_GPU_BATCH = 32
MIN_PER_GPU = 16
MAX_PER_GPU = 64


@dataclass(frozen=True)
class ElasticBounds:
    """How ``min_res``/``max_res`` derive from a trace job's ``num_gpu``."""

    min_factor: float = 0.5
    max_factor: float = 2.0

    def min_res(self, num_gpu: int) -> int:
        return max(1, math.ceil(self.min_factor * num_gpu))

    def max_res(self, num_gpu: int, cluster_gpus: int) -> int:
        return max(num_gpu, min(cluster_gpus, math.ceil(self.max_factor * num_gpu)))


DEFAULT_BOUNDS = ElasticBounds()


def jobs_from_trace(
    trace: Sequence[TraceJob],
    cluster_gpus: int,
    bounds: ElasticBounds = DEFAULT_BOUNDS,
    profiles: Mapping[str, ModelProfile] = TRACE_MODEL_PROFILES,
) -> list[JobSpec]:
    jobs = []
    for entry in trace:
        if entry.model_name not in profiles:
            raise SimulationError(
                f"job {entry.job_id}: no profile for model {entry.model_name!r} (known: {', '.join(sorted(profiles))};"
                " pass --profiles FILE)"
            )
        if entry.num_gpu > cluster_gpus:
            raise SimulationError(f"job {entry.job_id} asks for {entry.num_gpu} GPUs; the cluster has {cluster_gpus}")
        max_res = bounds.max_res(entry.num_gpu, cluster_gpus)
        batch = BatchSpec(PER_GPU_BATCH * entry.num_gpu, MIN_PER_GPU, MAX_PER_GPU, MIN_PER_GPU, MAX_PER_GPU * max_res)
        job = JobSpec(
            job_id=entry.job_id, submit_time=entry.submit_time, num_gpu=entry.num_gpu,
            min_res=min(bounds.min_res(entry.num_gpu), entry.num_gpu), max_res=max_res,
            profile=profiles[entry.model_name], batch=batch, samples=0.0, label=entry.model_name,
        )
        rate = job.rate(entry.num_gpu, BatchRule.FIXED)
        if rate is None:
            raise SimulationError(f"job {entry.job_id}: its submitted batch does not fit {entry.num_gpu} GPUs")
        job.samples = entry.duration * rate
        jobs.append(job)
    return jobs
