"""Job model: iteration time t_iter(b, k) = t_proc(⌈b/k⌉) + t_comm(k) (Saxena et al. §III-B) and the batch rules.

A job's work is a number of samples; its speed on ``k`` GPUs is ``b / t_iter(b, k)`` samples per second, where the
global batch ``b`` on ``k`` GPUs comes from one of three rules:

* ``fixed``: ``b`` is the job's global batch whatever ``k`` (Saxena et al.'s baseline; infeasible when ``⌈b/k⌉``
  exceeds the per-GPU limit or ``k > b``);
* ``hybrid``: Elan's hybrid scaling — keep the global batch (strong scaling) while the per-GPU batch stays in
  ``[min_per_gpu, max_per_gpu]``; below ``min_per_gpu`` grow it to ``k·min_per_gpu`` (capped at ``max_total``),
  above ``max_per_gpu`` shrink it to ``k·max_per_gpu`` (not below ``min_total``);
* ``optimal``: Saxena et al.'s ``b_opt(k)``, the feasible global batch in ``[min_total, max_total]`` with the highest
  throughput on ``k`` GPUs.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from lightning_elan.sim.errors import SimulationError

DEFAULT_PER_ITERATION_S = 0.010  # fixed cost of an iteration on one GPU (kernel launches, optimizer step)
DEFAULT_BANDWIDTH_BYTES_S = 4.9e9  # effective all-reduce bandwidth, fitted to Saxena et al.'s Table II
DEFAULT_LATENCY_S = 0.001  # per all-reduce start-up
BYTES_PER_PARAMETER = 4  # fp32 gradients


class BatchRule(str, Enum):
    FIXED = "fixed"
    HYBRID = "hybrid"
    OPTIMAL = "optimal"


@dataclass(frozen=True)
class CommModel:
    """Ring all-reduce: ``latency + 2(k-1)/k · bytes / bandwidth`` for ``k > 1``, nothing on one GPU."""

    bandwidth_bytes_s: float = DEFAULT_BANDWIDTH_BYTES_S
    latency_s: float = DEFAULT_LATENCY_S

    def allreduce_s(self, parameters: int, gpus: int) -> float:
        if gpus <= 1:
            return 0.0
        return self.latency_s + 2 * (gpus - 1) / gpus * parameters * BYTES_PER_PARAMETER / self.bandwidth_bytes_s


@dataclass(frozen=True)
class ModelProfile:
    """t_proc(b) = per_iteration_s + per_sample_s · b on one GPU, and the model's size for t_comm and the pauses.

    With ``rates`` (measured samples/s per GPU count, e.g. the ``rates`` of an ``elan profile`` result) the
    throughput comes from that table instead of the t_iter curve: :meth:`measured_rate`.
    """

    name: str
    parameters: int
    per_sample_s: float
    per_iteration_s: float = DEFAULT_PER_ITERATION_S
    rates: tuple[tuple[int, float], ...] = ()  # (GPUs, samples/s), ascending GPUs

    def proc_s(self, per_gpu_batch: int) -> float:
        return self.per_iteration_s + self.per_sample_s * per_gpu_batch

    def measured_rate(self, gpus: int) -> float:
        """Samples/s on ``gpus`` GPUs from ``rates``: exact where measured, linear between measured counts, flat
        beyond the largest (no speed-up is assumed that was not measured), and the smallest count's rate per GPU
        below it."""
        counts = [count for count, _ in self.rates]
        index = bisect.bisect_left(counts, gpus)
        if index < len(counts) and counts[index] == gpus:
            return self.rates[index][1]
        if index == 0:
            return self.rates[0][1] * gpus / counts[0]
        if index == len(counts):
            return self.rates[-1][1]
        (low, low_rate), (high, high_rate) = self.rates[index - 1], self.rates[index]
        return low_rate + (high_rate - low_rate) * (gpus - low) / (high - low)


# The Tiresias trace's models (TensorFlow benchmarks, ImageNet-sized inputs): parameter counts of the published
# architectures; per-sample compute times are round figures for one V100-class GPU (forward + backward), chosen so
# the relative speeds look like the TF benchmark tables. They are defaults, not measurements: pass a profile JSON.
TRACE_MODEL_PROFILES: dict[str, ModelProfile] = {
    profile.name: profile
    for profile in (
        ModelProfile("alexnet", 61_100_000, 0.0006),
        ModelProfile("googlenet", 6_600_000, 0.0012),
        ModelProfile("inception3", 23_800_000, 0.0028),
        ModelProfile("inception4", 42_700_000, 0.0055),
        ModelProfile("resnet50", 25_600_000, 0.0025),
        ModelProfile("resnet101", 44_500_000, 0.0043),
        ModelProfile("resnet152", 60_200_000, 0.0060),
        ModelProfile("vgg11", 132_900_000, 0.0025),
        ModelProfile("vgg16", 138_400_000, 0.0040),
        ModelProfile("vgg19", 143_700_000, 0.0048),
    )
}


@dataclass(frozen=True)
class BatchSpec:
    """A job's batch: ``global_batch`` as submitted and the bounds every rule respects."""

    global_batch: int
    min_per_gpu: int
    max_per_gpu: int
    min_total: int
    max_total: int


@dataclass
class JobSpec:
    """What the simulator knows of a job before it runs. ``samples`` is its whole work."""

    job_id: int
    submit_time: float
    num_gpu: int  # requested (static policies run it on exactly this many)
    min_res: int
    max_res: int
    profile: ModelProfile
    batch: BatchSpec
    samples: float
    comm: CommModel = field(default_factory=CommModel)
    label: str = ""
    _rates: dict[tuple[int, BatchRule], float | None] = field(default_factory=dict, repr=False, compare=False)

    def global_batch(self, gpus: int, rule: BatchRule) -> int | None:
        """The global batch on ``gpus`` GPUs under ``rule``, or None when infeasible."""
        if rule is BatchRule.FIXED:
            return fixed_batch(self.batch, gpus)
        if rule is BatchRule.HYBRID:
            return hybrid_batch(self.batch, gpus)
        return self._optimal_batch(gpus)

    def rate(self, gpus: int, rule: BatchRule) -> float | None:
        """Samples per second on ``gpus`` GPUs, None when the configuration is infeasible."""
        key = (gpus, rule)
        if key not in self._rates:
            batch = self.global_batch(gpus, rule) if gpus >= 1 else None
            self._rates[key] = None if batch is None else self._rate_at(batch, gpus)
        return self._rates[key]

    def reference_rate(self) -> float:
        """Saxena et al.'s baseline T_j(b_max, 1): one GPU at the largest per-GPU batch."""
        return self._rate_at(min(self.batch.max_per_gpu, self.batch.max_total), 1)

    def scaling_factor(self, gpus: int, rule: BatchRule) -> float | None:
        """Saxena et al.'s Eq. 1: the rate relative to :meth:`reference_rate`."""
        rate = self.rate(gpus, rule)
        return None if rate is None else rate / self.reference_rate()

    def iteration_s(self, batch: int, gpus: int) -> float:
        return self.profile.proc_s(math.ceil(batch / gpus)) + self.comm.allreduce_s(self.profile.parameters, gpus)

    def _rate_at(self, batch: int, gpus: int) -> float:
        if self.profile.rates:  # measured at the job's own batch: the batch rule only decides what is feasible
            return self.profile.measured_rate(gpus)
        return batch / self.iteration_s(batch, gpus)

    def _optimal_batch(self, gpus: int) -> int | None:
        spec = self.batch
        low, high = max(spec.min_total, gpus), min(spec.max_total, gpus * spec.max_per_gpu)
        if low > high:
            return None
        # the rate only changes with ⌈b/k⌉; for each per-GPU batch the largest b with that ceiling is best
        per_gpu_range = range(math.ceil(low / gpus), spec.max_per_gpu + 1)
        candidates = {high} | {min(high, gpus * per_gpu) for per_gpu in per_gpu_range}
        candidates = {batch for batch in candidates if batch >= low}
        return max(sorted(candidates), key=lambda batch: self._rate_at(batch, gpus))


def fixed_batch(spec: BatchSpec, gpus: int) -> int | None:
    batch = spec.global_batch
    if gpus > batch or math.ceil(batch / gpus) > spec.max_per_gpu:
        return None
    return batch


def hybrid_batch(spec: BatchSpec, gpus: int) -> int | None:
    batch = spec.global_batch
    if batch > gpus * spec.max_per_gpu:
        batch = gpus * spec.max_per_gpu
        return batch if batch >= spec.min_total else None
    if batch < gpus * spec.min_per_gpu:
        batch = min(gpus * spec.min_per_gpu, spec.max_total)
    return batch if batch >= gpus else None


def load_profiles(path: str | Path) -> dict[str, ModelProfile]:
    """A profile JSON, one entry per model name, each either a t_proc curve or a measured throughput table::

        {"resnet50": {"parameters": 25600000, "per_sample_s": 0.0025, "per_iteration_s": 0.010},
         "vgg19": {"parameters": 143700000, "rates": {"1": 61.0, "2": 98.5, "4": 150.2}}}

    ``rates``: samples/s per GPU count, as in an ``elan profile`` result (whose other keys are ignored).
    ``per_iteration_s`` defaults to 10 ms.
    """
    path = Path(path)
    if not path.is_file():
        raise SimulationError(f"profile file not found: {path}")
    try:
        raw = json.loads(path.read_text())
        return {name: _profile(name, entry) for name, entry in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SimulationError(f"{path}: not a profile JSON ({error})") from None


def _profile(name: str, entry: dict[str, object]) -> ModelProfile:
    parameters = int(entry["parameters"])  # type: ignore[call-overload]
    if parameters < 1:
        raise ValueError(f"{name}: parameters must be positive")
    if "rates" in entry:
        rates = sorted((int(count), float(rate)) for count, rate in entry["rates"].items())  # type: ignore[attr-defined]
        if not rates or any(count < 1 or not 0 < rate < math.inf for count, rate in rates):
            raise ValueError(f"{name}: rates must map GPU counts >= 1 to positive samples/s")
        return ModelProfile(name, parameters, 0.0, rates=tuple(rates))
    per_sample = float(entry["per_sample_s"])  # type: ignore[arg-type]
    per_iteration = float(entry.get("per_iteration_s", DEFAULT_PER_ITERATION_S))  # type: ignore[arg-type]
    if not (0 < per_sample < math.inf and 0 <= per_iteration < math.inf):
        raise ValueError(f"{name}: per_sample_s must be positive and per_iteration_s non-negative")
    return ModelProfile(name, parameters, per_sample, per_iteration)
