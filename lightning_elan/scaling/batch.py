"""Which global batch a job uses after a resize: strong, weak, or Elan's hybrid scaling (Algorithm 1). Pure.

Scale-out under ``hybrid`` follows Algorithm 1 of the Elan paper: try ``k = 1, 2, 4, …`` while ``k ≤ N'/N`` and keep
the smallest ``k·TBS`` whose optimal worker count ``N_opt`` (strong scaling at that batch) is at least ``N'``; if every
trial fails, weak-scale by ``N'/N``. Scale-in is the mirror image: keep the global batch unless the per-worker batch
would exceed ``max_local_batch``, then try ``k = 1/2, 1/4, …`` while ``k ≥ N'/N``, else weak-scale by ``N'/N``.

Limits: ``max_local_batch`` (memory) and ``max_global_batch`` (convergence) are hard caps on every result;
``min_local_batch`` makes Algorithm 1 skip trials whose per-worker batch would be smaller (more parallelism than work).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

POLICIES: tuple[str, ...] = ("strong", "weak", "hybrid")


class WorkerOptimizer(Protocol):
    """What Algorithm 1 needs from a throughput model."""

    def optimal_workers(self, global_batch: int, candidates: Iterable[int]) -> int: ...


class ReadyWorkerOptimizer(WorkerOptimizer, Protocol):
    def ready(self) -> bool: ...


@dataclass(frozen=True)
class ScalingLimits:
    """The user's ranges: per-worker batch within ``[min_local_batch, max_local_batch]``, global batch at most
    ``max_global_batch`` (``None``: no limit)."""

    min_local_batch: int = 1
    max_local_batch: int | None = None
    max_global_batch: int | None = None

    def __post_init__(self) -> None:
        if self.min_local_batch < 1:
            raise ValueError(f"min_local_batch must be >= 1, got {self.min_local_batch}")
        if self.max_local_batch is not None and self.max_local_batch < self.min_local_batch:
            raise ValueError(f"max_local_batch {self.max_local_batch} < min_local_batch {self.min_local_batch}")
        if self.max_global_batch is not None and self.max_global_batch < 1:
            raise ValueError(f"max_global_batch must be >= 1, got {self.max_global_batch}")

    def local_fits(self, global_batch: int, world_size: int) -> bool:
        """The largest per-worker share is within ``max_local_batch``."""
        return self.max_local_batch is None or math.ceil(global_batch / world_size) <= self.max_local_batch

    def local_big_enough(self, global_batch: int, world_size: int) -> bool:
        """The smallest per-worker share is at least ``min_local_batch``."""
        return global_batch // world_size >= self.min_local_batch

    def global_fits(self, global_batch: int) -> bool:
        return self.max_global_batch is None or global_batch <= self.max_global_batch

    def cap(self, global_batch: int, world_size: int) -> int:
        """``global_batch`` lowered to the hard caps (never below 1)."""
        capped = global_batch
        if self.max_global_batch is not None:
            capped = min(capped, self.max_global_batch)
        if self.max_local_batch is not None:
            capped = min(capped, self.max_local_batch * world_size)
        return max(1, capped)


@dataclass(frozen=True)
class ScalingDecision:
    """The global batch after a resize, the largest per-worker batch, ``k = new/old global batch`` and why.

    ``lr_scale`` is the LR multiplier (relative to the user's unscaled LR) the ramp should reach; the pure functions
    leave it ``None`` and :class:`~lightning_elan.callbacks.HybridScaling` fills it in.
    """

    global_batch: int
    local_batch: int
    k: float
    reason: str
    lr_scale: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ScalingDecision:
        lr_scale = state.get("lr_scale")
        return cls(
            global_batch=int(state["global_batch"]),
            local_batch=int(state["local_batch"]),
            k=float(state["k"]),
            reason=str(state["reason"]),
            lr_scale=None if lr_scale is None else float(lr_scale),
        )


def total_batch_size(
    n_old: int,
    tbs: int,
    n_new: int,
    model: WorkerOptimizer,
    limits: ScalingLimits | None = None,
    candidates: Iterable[int] | None = None,
) -> ScalingDecision:
    """Elan's Algorithm 1 (scale-out) and its mirror for scale-in.

    Args:
        n_old: workers before the adjustment (N).
        tbs: global batch before the adjustment (TBS).
        n_new: workers after the adjustment (N').
        model: gives ``N_opt`` through ``optimal_workers(global_batch, candidates)``.
        limits: the user's batch ranges.
        candidates: world sizes ``N_opt`` is chosen from; default ``1 … 2·max(N, N')``.
    """
    _check(n_old, tbs, n_new)
    limits = limits or ScalingLimits()
    if n_new == n_old:
        return _capped(tbs, tbs, n_new, limits, "world size unchanged")
    if n_new < n_old:
        return shrink_global_batch(n_old, tbs, n_new, limits)
    pool = list(candidates) if candidates is not None else list(range(1, 2 * max(n_old, n_new) + 1))
    return _grow(n_old, tbs, n_new, model, limits, pool)


def _grow(
    n_old: int, tbs: int, n_new: int, model: WorkerOptimizer, limits: ScalingLimits, pool: list[int]
) -> ScalingDecision:
    trials: list[str] = []
    k = 1
    while k * n_old <= n_new:  # k ≤ N'/N
        trial = k * tbs
        if not limits.global_fits(trial):
            trials.append(f"{trial} > max_global_batch")
            break
        if not limits.local_big_enough(trial, n_new):
            trials.append(f"{trial}: local batch {trial // n_new} < min_local_batch {limits.min_local_batch}")
        else:
            n_opt = model.optimal_workers(trial, pool)
            if n_opt >= n_new:
                how = "strong scaling" if k == 1 else f"global batch x{k}"
                return _capped(tbs, trial, n_new, limits, f"hybrid: N_opt({trial})={n_opt} >= {n_new}: {how}")
            trials.append(f"N_opt({trial})={n_opt} < {n_new}")
        k *= 2
    weak = _scaled(tbs, n_new, n_old)
    return _capped(tbs, weak, n_new, limits, f"hybrid: all trials failed ({'; '.join(trials)}): weak scaling")


def shrink_global_batch(n_old: int, tbs: int, n_new: int, limits: ScalingLimits | None = None) -> ScalingDecision:
    """Scale-in: keep ``tbs`` unless the per-worker batch would exceed ``max_local_batch``; then halve it while
    ``k ≥ N'/N``; else weak-scale by ``N'/N``."""
    _check(n_old, tbs, n_new)
    limits = limits or ScalingLimits()
    halvings = 0
    while n_old >= (2**halvings) * n_new:  # k = 1/2^j ≥ N'/N
        trial = max(1, tbs // 2**halvings)
        if limits.local_fits(trial, n_new):
            how = "global batch kept" if halvings == 0 else f"global batch /{2**halvings} (max_local_batch)"
            return _capped(tbs, trial, n_new, limits, f"scale-in: {how}")
        halvings += 1
    weak = _scaled(tbs, n_new, n_old)
    return _capped(tbs, weak, n_new, limits, "scale-in: local batch over max_local_batch at every k: weak scaling")


def scale_global_batch(
    policy: str,
    n_old: int,
    n_new: int,
    global_batch: int,
    model: ReadyWorkerOptimizer | None = None,
    limits: ScalingLimits | None = None,
    candidates: Iterable[int] | None = None,
) -> ScalingDecision:
    """The global batch after ``n_old → n_new`` under ``policy``: ``strong`` keeps it (within the caps), ``weak`` scales
    it by ``n_new/n_old``, ``hybrid`` runs Algorithm 1 once ``model.ready()`` (strong until then)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    _check(n_old, global_batch, n_new)
    limits = limits or ScalingLimits()
    if policy == "weak":
        weak = _scaled(global_batch, n_new, n_old)
        return _capped(global_batch, weak, n_new, limits, f"weak: global batch x{n_new}/{n_old}")
    if policy == "hybrid" and model is not None and model.ready():
        return total_batch_size(n_old, global_batch, n_new, model, limits, candidates)
    prefix = "strong" if policy == "strong" else "hybrid (throughput model not ready yet): strong"
    if n_new < n_old:
        decision = shrink_global_batch(n_old, global_batch, n_new, limits)
        return _with_reason(decision, f"{prefix}; {decision.reason}")
    return _capped(global_batch, global_batch, n_new, limits, f"{prefix}: global batch kept")


def _capped(old: int, new: int, world_size: int, limits: ScalingLimits, reason: str) -> ScalingDecision:
    capped = limits.cap(new, world_size)
    if capped != new:
        reason = f"{reason}; {new} capped to {capped} (max_global_batch/max_local_batch)"
    return ScalingDecision(capped, math.ceil(capped / world_size), capped / old, reason)


def _with_reason(decision: ScalingDecision, reason: str) -> ScalingDecision:
    return ScalingDecision(decision.global_batch, decision.local_batch, decision.k, reason, decision.lr_scale)


def _scaled(global_batch: int, numerator: int, denominator: int) -> int:
    """``global_batch · numerator / denominator`` rounded half up, at least 1."""
    return max(1, (2 * global_batch * numerator + denominator) // (2 * denominator))


def _check(n_old: int, global_batch: int, n_new: int) -> None:
    if n_old < 1 or n_new < 1:
        raise ValueError(f"world sizes must be >= 1, got {n_old} -> {n_new}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
