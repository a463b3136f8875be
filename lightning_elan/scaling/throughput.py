"""Throughput model ``t_iter(b, n) = t_compute(ceil(b / n)) + t_allreduce(n, bytes)``, fitted online (pure: numpy only).

Compute time is kept per local batch size and all-reduce time per world size, each as a running mean over a window
of recent steps. Predictions:

* ``t_compute(b)``: piecewise-linear interpolation through the per-size means, made non-decreasing in ``b`` (pool
  adjacent violators); outside the observed sizes it continues with the slope of a weighted affine fit ``c0 + c1·b``
  (slope ≥ 0), never below 0. With one observed size it is proportional to ``b``.
* ``t_allreduce(n, bytes)``: 0 for one worker; the measured mean at an observed world size (for the job's own gradient
  size); elsewhere the ring-all-reduce fit ``α + β·(n−1)/n·bytes`` (α, β ≥ 0; with one observed world size α = 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_VERSION = 1
_TIE = 1e-9  # relative throughput difference below which the smaller world size wins


@dataclass
class RunningMean:
    """Mean of the last ``window`` values or so: the count saturates at the window, so old values fade out."""

    count: int = 0
    mean: float = 0.0

    def add(self, value: float, window: int) -> None:
        self.count = min(self.count + 1, window)
        self.mean += (value - self.mean) / self.count


@dataclass(frozen=True)
class _ComputeCurve:
    sizes: np.ndarray
    times: np.ndarray
    slope: float

    def __call__(self, local_batch: float) -> float:
        low, high = float(self.sizes[0]), float(self.sizes[-1])
        if local_batch <= low:
            return max(0.0, float(self.times[0]) - self.slope * (low - local_batch))
        if local_batch >= high:
            return float(self.times[-1]) + self.slope * (local_batch - high)
        return float(np.interp(local_batch, self.sizes, self.times))


class ThroughputModel:
    """Step time of a data-parallel job as a function of global batch and world size, learned from measured steps.

    Args:
        min_observations: steps a point needs before it counts for :meth:`ready`.
        window: the running means weigh about this many recent steps.
        grad_bytes: bytes all-reduced per step (the job's gradients); scales the bandwidth term for other sizes.
    """

    def __init__(self, min_observations: int = 3, window: int = 50, grad_bytes: int | None = None) -> None:
        if min_observations < 1 or window < 1:
            raise ValueError(f"min_observations and window must be >= 1, got {min_observations}, {window}")
        self.min_observations = min_observations
        self.window = window
        self.grad_bytes = grad_bytes
        self._compute: dict[int, RunningMean] = {}
        self._allreduce: dict[int, RunningMean] = {}
        self._curve: _ComputeCurve | None = None
        self._fit: tuple[float, float] | None = None

    # ------------------------------------------------------------------ observations

    def observe_step(self, local_batch: int, world_size: int, compute_s: float, allreduce_s: float) -> None:
        """Record one step: this worker's local batch, the world size, and the step's compute and all-reduce time."""
        if local_batch < 1 or world_size < 1:
            return
        self._compute.setdefault(int(local_batch), RunningMean()).add(max(0.0, float(compute_s)), self.window)
        self._curve = None
        if world_size > 1:
            self._allreduce.setdefault(int(world_size), RunningMean()).add(max(0.0, float(allreduce_s)), self.window)
            self._fit = None

    def ready(self) -> bool:
        """Enough points to extrapolate: two local batch sizes and one world size > 1, each seen often enough."""
        compute_points = sum(1 for mean in self._compute.values() if mean.count >= self.min_observations)
        allreduce_points = sum(1 for mean in self._allreduce.values() if mean.count >= self.min_observations)
        return compute_points >= 2 and allreduce_points >= 1

    def observation_counts(self) -> dict[str, dict[str, int]]:
        return {
            "compute": {str(size): mean.count for size, mean in sorted(self._compute.items())},
            "allreduce": {str(size): mean.count for size, mean in sorted(self._allreduce.items())},
        }

    def world_sizes_seen(self) -> list[int]:
        return sorted(self._allreduce)

    def can_predict(self, world_size: int) -> bool:
        return bool(self._compute) and (world_size <= 1 or bool(self._allreduce))

    # ------------------------------------------------------------------ predictions

    def t_compute(self, local_batch: int) -> float:
        if not self._compute:
            raise ValueError("no compute time observed yet")
        if self._curve is None:
            self._curve = _fit_compute_curve(self._compute)
        return self._curve(local_batch)

    def t_allreduce(self, world_size: int, nbytes: int | None = None) -> float:
        if world_size <= 1:
            return 0.0
        if not self._allreduce:
            raise ValueError("no all-reduce time observed yet")
        same_message = nbytes is None or nbytes == self.grad_bytes
        point = self._allreduce.get(world_size)
        if point is not None and same_message:
            return point.mean
        if self._fit is None:
            self._fit = _fit_allreduce(self._allreduce)
        alpha, beta = self._fit
        return alpha + beta * _ring_factor(world_size) * self._message_ratio(nbytes)

    def _message_ratio(self, nbytes: int | None) -> float:
        if nbytes is None or not self.grad_bytes:
            return 1.0
        return nbytes / self.grad_bytes

    def t_iter(self, global_batch: int, world_size: int) -> float:
        """Seconds per step: the slowest rank's compute (``ceil(b/n)`` samples) plus the all-reduce."""
        local_batch = max(1, math.ceil(global_batch / world_size))
        return self.t_compute(local_batch) + self.t_allreduce(world_size)

    def throughput(self, global_batch: int, world_size: int) -> float:
        """Samples per second."""
        return global_batch / max(self.t_iter(global_batch, world_size), 1e-12)

    def optimal_workers(self, global_batch: int, candidates: Iterable[int]) -> int:
        """The world size among ``candidates`` with the highest throughput (the smaller one on a tie): N_opt."""
        best, best_throughput = None, -1.0
        for world_size in sorted(set(candidates)):
            value = self.throughput(global_batch, world_size)
            if best is None or value > best_throughput * (1 + _TIE):
                best, best_throughput = world_size, value
        if best is None:
            raise ValueError("no candidate world size")
        return best

    # ------------------------------------------------------------------ state (JSON-able)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "min_observations": self.min_observations,
            "window": self.window,
            "grad_bytes": self.grad_bytes,
            "compute": [[size, mean.count, mean.mean] for size, mean in sorted(self._compute.items())],
            "allreduce": [[size, mean.count, mean.mean] for size, mean in sorted(self._allreduce.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.min_observations = int(state.get("min_observations", self.min_observations))
        self.window = int(state.get("window", self.window))
        self.grad_bytes = None if state.get("grad_bytes") is None else int(state["grad_bytes"])
        self._compute = {int(size): RunningMean(int(count), float(mean)) for size, count, mean in state["compute"]}
        self._allreduce = {int(size): RunningMean(int(count), float(mean)) for size, count, mean in state["allreduce"]}
        self._curve = self._fit = None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ThroughputModel:
        model = cls()
        model.load_state_dict(state)
        return model


def _ring_factor(world_size: int) -> float:
    return (world_size - 1) / world_size


def _fit_compute_curve(points: dict[int, RunningMean]) -> _ComputeCurve:
    sizes = np.array(sorted(points), dtype=float)
    times = np.array([points[int(size)].mean for size in sizes])
    weights = np.array([float(points[int(size)].count) for size in sizes])
    times = _non_decreasing(times, weights)
    if len(sizes) == 1:
        slope = float(times[0] / sizes[0])
    else:
        slope = max(0.0, _weighted_affine(sizes, times, weights)[1])
    return _ComputeCurve(sizes, times, slope)


def _fit_allreduce(points: dict[int, RunningMean]) -> tuple[float, float]:
    """``α, β`` of ``α + β·(n−1)/n`` (bytes folded into β), both ≥ 0."""
    sizes = sorted(points)
    x = np.array([_ring_factor(size) for size in sizes])
    y = np.array([points[size].mean for size in sizes])
    w = np.array([float(points[size].count) for size in sizes])
    if len(sizes) == 1:
        return 0.0, float(y[0] / x[0])
    alpha, beta = _weighted_affine(x, y, w)
    if beta < 0:
        return float(np.average(y, weights=w)), 0.0
    if alpha < 0:
        return 0.0, float(np.sum(w * x * y) / np.sum(w * x * x))
    return alpha, beta


def _weighted_affine(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares ``y ≈ a + b·x``: returns ``(a, b)``."""
    mean_x, mean_y = np.average(x, weights=w), np.average(y, weights=w)
    spread = float(np.sum(w * (x - mean_x) ** 2))
    if spread == 0.0:
        return float(mean_y), 0.0
    slope = float(np.sum(w * (x - mean_x) * (y - mean_y)) / spread)
    return float(mean_y - slope * mean_x), slope


def _non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic regression (pool adjacent violators): the closest non-decreasing sequence."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_b, weight_b, length_b), (mean_a, weight_a, length_a) = blocks.pop(), blocks.pop()
            total = weight_a + weight_b
            blocks.append([(mean_a * weight_a + mean_b * weight_b) / total, total, length_a + length_b])
    return np.array([mean for mean, _, length in blocks for _ in range(int(length))])
