"""Autoscaling policies of Or et al., "Resource elasticity in distributed deep learning" (MLSys 2020), §4: pure
decisions (no Lightning, no process group) from the job's aggregate throughput R_k (samples/s) at each size k.

``ThroughputAutoscaler`` is the §4.1 schedule with the §4.2.1 condition s_{k,d} > S. It adds ``step`` workers while
the last addition paid; when one does not, it keeps the size before it (Figure 3, left). When the *first* addition
fails, the best size may be below the start, so it walks down, ``step`` at a time, to the next size without runtime
statistics (Figure 3, right) until the condition from that size up to the one above holds, and settles on the upper
one (the paper keeps "the point before the conditions first begin to fail"); at ``min_workers`` it settles there.
Our choices where the paper is silent: sizes already in ``rates`` are judged from their statistics without a move;
a job started at ``max_workers`` first removes ``step`` (the paper's "remove K workers if at the upper limit") and
then follows the same walk down; asked again before the job moved, it repeats its request; a job measured at a
size other than the one asked for (a failure, a partly granted request) restarts the search from that size, reusing
every rate measured so far; once settled the policy answers None forever (the settling decision carries the size to
go back to, when the job is elsewhere).

``UtilityAutoscaler`` is the §4.2.2 rule: with T(k) = elapsed + remaining / R_k and the remaining cost C(k) = P * k
* remaining / R_k (the paper's t_k * b * k * P; the past cost C_p cancels in every comparison), move to k' = k ±
step only if the net value V(k') = U(T(k')) - C(k') is strictly higher than V(k), i.e. the paper's U(T(k+d)) -
U(T(k)) > C(k+d) - C(k) for growing and its mirror (the cost saved exceeds the utility lost) for shrinking, which
the paper does not describe; if both neighbours beat V(k) the better wins (the smaller on a tie). It keeps no search
state (only the filled-in horizon) and ignores the pause a resize costs. The paper discovers the curve by trying; we
must guess R at a size not measured yet: beyond the measured range, extrapolate with the scaling efficiency of the
two nearest measured sizes, clamped to [0, 1] (never super-linear, never a throughput drop); with a single measured
size, linear (s = 1, the paper's schedule always tries the first step); between two measured sizes, interpolate
linearly. Every decision lists the sizes it estimated in ``inputs["estimated"]`` and says so in its reason.
``UtilityFunction`` is the user's U(T): steps (value if finished by a deadline) whose gaps are bridged linearly from
the right end of each step to the right end of the next (Figure 5c); the last step falls to ``after`` at
``horizon_s`` (the paper's T_0, the job's initial completion time, which the autoscaler fills in on its first
decision when the file gives none; twice the last deadline if the job starts on track to meet it), or a
piecewise-linear curve of points for the linear and concave shapes of Figure 5.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_elan.words import plural

log = logging.getLogger(__name__)

__all__ = [
    "SizeDecision",
    "ThroughputAutoscaler",
    "UtilityAutoscaler",
    "UtilityFunction",
    "estimate_rate",
    "scaling_efficiency",
]


def scaling_efficiency(rates: Mapping[int, float], k: int, d: int) -> float:
    """s_{k,d} = ((R_{k+d} - R_k) / d) / r_k with r_k = R_k / k."""
    if k < 1 or d < 1:
        raise ValueError(f"scaling efficiency needs k >= 1 and d >= 1, got k={k}, d={d}")
    for size in (k, k + d):
        if size not in rates:
            raise ValueError(f"scaling efficiency s_{{{k},{d}}} needs the rate at {size} workers")
    if rates[k] <= 0:
        raise ValueError(f"the rate at {k} workers must be positive, got {rates[k]}")
    return ((rates[k + d] - rates[k]) / d) / (rates[k] / k)


def estimate_rate(rates: Mapping[int, float], size: int) -> float:
    """R at ``size``: measured, interpolated between measured sizes, or extrapolated with the nearest efficiency."""
    if size in rates:
        return float(rates[size])
    known = sorted(rates)
    if not known:
        raise ValueError("cannot estimate a rate without any measured size")
    below = [k for k in known if k < size]
    above = [k for k in known if k > size]
    if below and above:
        a, b = below[-1], above[0]
        return rates[a] + (size - a) * (rates[b] - rates[a]) / (b - a)
    if below:
        return _extrapolate_up(rates, below, size)
    return _extrapolate_down(rates, above, size)


def _sizes(rates: Mapping[Any, float]) -> dict[int, float]:
    """``rates`` with int sizes (JSON turns them into strings) and float rates."""
    return {int(k): float(v) for k, v in rates.items()}


def _clamped_efficiency(rates: Mapping[int, float], a: int, b: int) -> float:
    """s_{a,b-a} clamped to [0, 1]."""
    return min(1.0, max(0.0, scaling_efficiency(rates, a, b - a)))


def _extrapolate_up(rates: Mapping[int, float], below: list[int], size: int) -> float:
    """R_size above every measured size: R_b + (size - b) * s * R_b / b."""
    b = below[-1]
    s = _clamped_efficiency(rates, below[-2], b) if len(below) > 1 else 1.0
    return rates[b] + (size - b) * s * rates[b] / b


def _extrapolate_down(rates: Mapping[int, float], above: list[int], size: int) -> float:
    """R_size below every measured size: the R_size for which s_{size, a - size} equals the nearest efficiency."""
    a = above[0]
    s = _clamped_efficiency(rates, a, above[1]) if len(above) > 1 else 1.0
    return rates[a] / (1.0 + (a - size) * s / size)


def _workers(count: int) -> str:
    """``1 worker``, ``3 workers``."""
    return plural(count, "worker")


def _sizes_phrase(sizes: list[int]) -> str:
    """``1 worker``, ``3 workers``, ``1, 3 workers``."""
    return _workers(sizes[0]) if len(sizes) == 1 else f"{', '.join(map(str, sizes))} workers"


def _bounds_error(min_workers: int, max_workers: int | None, step: int) -> str | None:
    """The problem with the size limits and step, if any."""
    if step < 1:
        return f"step must be >= 1, got {step}"
    if min_workers < 1:
        return f"min_workers must be >= 1, got {min_workers}"
    if max_workers is not None and max_workers < min_workers:
        return f"min_workers ({min_workers}) must be <= max_workers ({max_workers})"
    return None


@dataclass(frozen=True)
class SizeDecision:
    """A world size to move to, why, and the numbers the decision used."""

    target: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "reason": self.reason, "inputs": dict(self.inputs)}


class ThroughputAutoscaler:
    """Or et al. §4.1 schedule with the §4.2.1 throughput scaling-efficiency condition (see the module docstring)."""

    def __init__(
        self, step: int = 1, threshold: float = 0.1, min_workers: int = 1, max_workers: int | None = None
    ) -> None:
        problem = _bounds_error(min_workers, max_workers, step)
        if problem:
            raise ValueError(problem)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        self.step = step
        self.threshold = threshold
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.phase = "start"  # start | grow | descend | settled
        self.anchor: int | None = None  # grow: the last size worth having; descend: the lowest size in question
        self.passed = False  # an addition has paid since the search (re)started
        self.pending: int | None = None  # the size asked for, not measured yet
        self.origin: int | None = None  # the size the job was at when it asked for ``pending``
        self.settled_size: int | None = None
        self.settle_reason: str | None = None
        self.evaluations: list[dict[str, Any]] = []  # every s_{k,d} computed, in order

    @property
    def settled(self) -> bool:
        return self.phase == "settled"

    def decide(self, current: int, rates: Mapping[int, float]) -> SizeDecision | None:
        """The next size once the job has been measured at ``current``; None to stay (also before it is measured)."""
        rates = _sizes(rates)
        if self.settled or current not in rates:
            return None
        if current != self._clamp(current):
            reason = f"{_workers(current)} is outside [{self.min_workers}, {self.max_workers}]"
            return self._move(current, self._clamp(current), reason, rates, restart=True)
        if self.pending is not None and current == self.origin:
            return self._waiting(rates)
        if self.phase != "start" and current != self.pending:
            log.info("measured at %d workers, asked for %s: the search starts over", current, self.pending)
            self.phase = "start"
        if self.phase == "start":
            self._start(current)
        self.pending = self.origin = None
        return self._walk(current, rates)

    def _waiting(self, rates: Mapping[int, float]) -> SizeDecision:
        """The job is still where it asked from: the same request again."""
        assert self.pending is not None
        return SizeDecision(
            self.pending, f"still waiting for {_workers(self.pending)}", self._inputs(self.pending, rates)
        )

    def _start(self, current: int) -> None:
        """Begin (or restart) the search at ``current``."""
        self.anchor = current
        self.passed = False
        self.phase = "grow" if current < self._upper() else "descend"

    def _walk(self, current: int, rates: Mapping[int, float]) -> SizeDecision | None:
        """Judge every step whose sizes are measured; stop at the first size to visit or at the settled size."""
        while not self.settled:
            anchor = self.anchor
            assert anchor is not None
            if self.phase == "grow":
                nxt = min(anchor + self.step, self._upper())
                if nxt == anchor:
                    self._settle(anchor, f"{_workers(anchor)} is the upper limit and the last addition paid")
                elif nxt not in rates:
                    return self._move(current, nxt, f"try {_workers(nxt)} (from {anchor})", rates)
                else:
                    self._judge_growth(anchor, nxt, rates)
            else:
                lower = max(anchor - self.step, self.min_workers)
                if lower == anchor:
                    self._settle(anchor, f"{_workers(anchor)} is the lower limit")
                elif lower not in rates:
                    reason = f"look below {_workers(anchor)}: try {lower}"
                    return self._move(current, lower, reason, rates)
                else:
                    self._judge_descent(lower, anchor, rates)
        return self._settled_decision(current, rates)

    def _judge_growth(self, k: int, nxt: int, rates: Mapping[int, float]) -> None:
        """Growing k -> nxt: go on if it paid, else keep k (or walk down if no addition has paid yet)."""
        s = self._efficiency(rates, k, nxt)
        if s > self.threshold:
            self.anchor, self.passed = nxt, True
        elif self.passed:
            self._settle(k, f"{k} -> {nxt} workers did not pay (s = {s:.3f} <= {self.threshold})")
        else:
            self.phase = "descend"

    def _judge_descent(self, lower: int, upper: int, rates: Mapping[int, float]) -> None:
        """Walking down: settle at ``upper`` once lower -> upper pays, else go on below ``lower``."""
        s = self._efficiency(rates, lower, upper)
        if s > self.threshold:
            self._settle(upper, f"{lower} -> {upper} workers pays (s = {s:.3f} > {self.threshold}) and no more does")
        else:
            self.anchor = lower

    def _efficiency(self, rates: Mapping[int, float], k: int, nxt: int) -> float:
        """s_{k, nxt-k}, recorded."""
        s = scaling_efficiency(rates, k, nxt - k)
        self.evaluations.append({"k": k, "d": nxt - k, "efficiency": s, "passed": s > self.threshold})
        return s

    def _settle(self, size: int, reason: str) -> None:
        self.phase, self.settled_size, self.settle_reason = "settled", size, f"settled at {_workers(size)}: {reason}"
        log.info(self.settle_reason)

    def _settled_decision(self, current: int, rates: Mapping[int, float]) -> SizeDecision | None:
        """The move back to the settled size, if the job is elsewhere."""
        assert self.settled_size is not None and self.settle_reason is not None
        if self.settled_size == current:
            return None
        return SizeDecision(self.settled_size, self.settle_reason, self._inputs(self.settled_size, rates))

    def _move(
        self, current: int, target: int, reason: str, rates: Mapping[int, float], restart: bool = False
    ) -> SizeDecision:
        """Ask for ``target`` workers from ``current``."""
        self.pending, self.origin = target, current
        if restart:
            self.phase = "start"
        inputs = self._inputs(target, rates)
        last = self.evaluations[-1] if self.evaluations else None
        if last is not None and not restart:
            reason += f"; last s_{{{last['k']},{last['d']}}} = {last['efficiency']:.3f} vs threshold {self.threshold}"
        return SizeDecision(target, reason, inputs)

    def _inputs(self, target: int, rates: Mapping[int, float]) -> dict[str, Any]:
        return {
            "policy": "throughput",
            "target": target,
            "rates": {int(k): float(v) for k, v in sorted(rates.items())},
            "threshold": self.threshold,
            "step": self.step,
            "evaluations": list(self.evaluations),
        }

    def _upper(self) -> int:
        return self.max_workers if self.max_workers is not None else 2**31

    def _clamp(self, size: int) -> int:
        return min(max(size, self.min_workers), self._upper())

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "threshold": self.threshold,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "phase": self.phase,
            "anchor": self.anchor,
            "passed": self.passed,
            "pending": self.pending,
            "origin": self.origin,
            "settled_size": self.settled_size,
            "settle_reason": self.settle_reason,
            "evaluations": list(self.evaluations),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThroughputAutoscaler:
        scaler = cls(data["step"], data["threshold"], data["min_workers"], data.get("max_workers"))
        scaler.phase = data.get("phase", "start")
        scaler.anchor = data.get("anchor")
        scaler.passed = bool(data.get("passed", False))
        scaler.pending = data.get("pending")
        scaler.origin = data.get("origin")
        scaler.settled_size = data.get("settled_size")
        scaler.settle_reason = data.get("settle_reason")
        scaler.evaluations = [dict(e) for e in data.get("evaluations", [])]
        return scaler


class UtilityFunction:
    """U(T), the value (e.g. dollars) of finishing at completion time T seconds: non-increasing in T."""

    def __init__(
        self,
        steps: list[tuple[float, float]] | None = None,
        after: float = 0.0,
        horizon_s: float | None = None,
        points: list[tuple[float, float]] | None = None,
    ) -> None:
        if (steps is None) == (points is None):
            raise ValueError("a utility function needs exactly one of 'steps' or 'points'")
        curve = steps if steps is not None else points
        assert curve is not None
        _check_curve(curve, "steps" if steps is not None else "points")
        if steps is not None and after > steps[-1][1]:
            raise ValueError(f"'after' ({after}) must not exceed the last step's value ({steps[-1][1]})")
        if steps is not None and horizon_s is not None and horizon_s <= steps[-1][0]:
            raise ValueError(f"horizon_s ({horizon_s}) must be after the last deadline ({steps[-1][0]})")
        self.steps = [(float(t), float(u)) for t, u in steps] if steps is not None else None
        self.points = [(float(t), float(u)) for t, u in points] if points is not None else None
        self.after = float(after)
        self.horizon_s = None if horizon_s is None else float(horizon_s)

    def value(self, completion_time_s: float) -> float:
        """U at ``completion_time_s``: steps bridged linearly (Figure 5c), or the points' piecewise-linear curve."""
        if self.points is not None:
            return _piecewise(self.points, completion_time_s)
        assert self.steps is not None
        corners = list(self.steps)
        if self.horizon_s is not None:
            corners.append((self.horizon_s, self.after))
        elif completion_time_s > corners[-1][0]:
            return self.after  # no horizon: the last step ends in a cliff
        return _piecewise(corners, completion_time_s)

    @property
    def bridged_last_step(self) -> bool:
        """Whether the last step's drop to ``after`` needs a horizon (steps, no horizon, a drop)."""
        return self.steps is not None and self.horizon_s is None and self.after < self.steps[-1][1]

    def with_horizon(self, horizon_s: float) -> UtilityFunction:
        """The same steps with the last one bridged to ``after`` at ``horizon_s`` (the paper's T_0)."""
        assert self.steps is not None
        return UtilityFunction(steps=self.steps, after=self.after, horizon_s=horizon_s)

    def to_dict(self) -> dict[str, Any]:
        if self.points is not None:
            return {"points": [[t, u] for t, u in self.points]}
        assert self.steps is not None
        data: dict[str, Any] = {"steps": [{"deadline_s": t, "value": u} for t, u in self.steps], "after": self.after}
        if self.horizon_s is not None:
            data["horizon_s"] = self.horizon_s
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UtilityFunction:
        """From ``{"steps": [{"deadline_s", "value"}...], "after", "horizon_s"}`` or ``{"points": [[t, u]...]}``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a utility function is a mapping, got {type(data).__name__}")
        unknown = set(data) - {"steps", "after", "horizon_s", "points"}
        if unknown:
            raise ValueError(f"unknown utility keys {sorted(unknown)} (expected steps, after, horizon_s or points)")
        try:
            steps = [_step_pair(s) for s in data["steps"]] if "steps" in data else None
            points = [_point_pair(p) for p in data["points"]] if "points" in data else None
            after = float(data.get("after", 0.0))
            horizon = data.get("horizon_s")
            horizon_s = None if horizon is None else float(horizon)
        except (TypeError, KeyError, IndexError) as err:
            raise ValueError(f"malformed utility function: {err!r}") from err
        return cls(steps=steps, after=after, horizon_s=horizon_s, points=points)

    @classmethod
    def from_file(cls, path: str | Path) -> UtilityFunction:
        """From a JSON file, or YAML (``.yaml``/``.yml``)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise ValueError(f"utility file {path}: cannot read it ({err.strerror or err})") from err
        try:
            data = _parse(text, path)
        except ValueError as err:
            raise ValueError(f"utility file {path}: not valid {'YAML' if _is_yaml(path) else 'JSON'}: {err}") from err
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"utility file {path}: {err}") from err

    def __repr__(self) -> str:
        return f"UtilityFunction({self.to_dict()})"


def _is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def _parse(text: str, path: Path) -> Any:
    """JSON, or YAML for a .yaml/.yml file; ValueError on a syntax error."""
    if not _is_yaml(path):
        return json.loads(text)  # JSONDecodeError is a ValueError
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(str(err)) from err


def _step_pair(step: Any) -> tuple[float, float]:
    if not isinstance(step, Mapping):
        raise ValueError(f"each step is a mapping with deadline_s and value, got {step!r}")
    missing = {"deadline_s", "value"} - set(step)
    if missing:
        raise ValueError(f"step {dict(step)} lacks {sorted(missing)}")
    return float(step["deadline_s"]), float(step["value"])


def _point_pair(point: Any) -> tuple[float, float]:
    if isinstance(point, Mapping):
        return float(point["t_s"]), float(point["value"])
    if not isinstance(point, (list, tuple)) or len(point) != 2:
        raise ValueError(f"each point is [time_s, value] or {{t_s, value}}, got {point!r}")
    return float(point[0]), float(point[1])


def _check_curve(curve: list[tuple[float, float]], name: str) -> None:
    """Finite, times >= 0 and strictly increasing, values non-increasing (a rational user, §4.2.2)."""
    if not curve:
        raise ValueError(f"'{name}' is empty")
    if any(not (math.isfinite(t) and math.isfinite(u)) for t, u in curve) or curve[0][0] < 0:
        raise ValueError(f"'{name}' needs finite values and times >= 0")
    for (t0, u0), (t1, u1) in itertools.pairwise(curve):
        if not t1 > t0:
            raise ValueError(f"'{name}' times must increase strictly, got {t0} then {t1}")
        if u1 > u0:
            raise ValueError(f"'{name}' values must not increase with time (U is non-increasing), got {u0} then {u1}")


def _piecewise(corners: list[tuple[float, float]], t: float) -> float:
    """The linear interpolation through ``corners``, flat before the first and after the last."""
    if t <= corners[0][0]:
        return corners[0][1]
    for (t0, u0), (t1, u1) in itertools.pairwise(corners):
        if t <= t1:
            return u0 + (u1 - u0) * (t - t0) / (t1 - t0)
    return corners[-1][1]


class UtilityAutoscaler:
    """Or et al. §4.2.2: move by ``step`` while the utility gained exceeds the added cost (see the module docstring)."""

    def __init__(
        self,
        price_per_worker_s: float,
        utility: UtilityFunction,
        step: int = 1,
        min_workers: int = 1,
        max_workers: int | None = None,
    ) -> None:
        problem = _bounds_error(min_workers, max_workers, step)
        if problem:
            raise ValueError(problem)
        if not price_per_worker_s >= 0 or not math.isfinite(price_per_worker_s):
            raise ValueError(f"price_per_worker_s must be a finite number >= 0, got {price_per_worker_s}")
        if not isinstance(utility, UtilityFunction):
            raise ValueError(f"utility must be a UtilityFunction, got {type(utility).__name__}")
        self.price_per_worker_s = float(price_per_worker_s)
        self.utility = utility
        self.step = step
        self.min_workers = min_workers
        self.max_workers = max_workers

    def decide(
        self, current: int, rates: Mapping[int, float], remaining_samples: float, elapsed_s: float
    ) -> SizeDecision | None:
        """Move to current ± step if its net value U(T) - C beats the current one; None to stay."""
        if remaining_samples < 0 or elapsed_s < 0:
            raise ValueError(f"remaining_samples and elapsed_s must be >= 0, got {remaining_samples}, {elapsed_s}")
        rates = _sizes(rates)
        if current not in rates or remaining_samples == 0:
            return None
        if rates[current] <= 0:
            raise ValueError(f"the rate at {current} workers must be positive, got {rates[current]}")
        self._fill_horizon(elapsed_s + remaining_samples / rates[current])
        if self._clamp(current) != current:
            target = self._clamp(current)
            bounds = f"[{self.min_workers}, {self.max_workers}]"
            return SizeDecision(target, f"{_workers(current)} is outside {bounds}", {"policy": "utility"})
        candidates = sorted({self._clamp(current - self.step), self._clamp(current + self.step)} - {current})
        values = {k: self._evaluate(k, rates, remaining_samples, elapsed_s) for k in [current, *candidates]}
        best = max(candidates, key=lambda k: (values[k]["net"], -k), default=current)
        if best == current or not values[best]["net"] > values[current]["net"]:
            return None
        return self._decision(current, best, values, rates, remaining_samples, elapsed_s)

    def _fill_horizon(self, completion_s: float) -> None:
        """Bridge the last step to the job's first completion estimate T_0 (Figure 5c), once."""
        if not self.utility.bridged_last_step:
            return
        assert self.utility.steps is not None
        last_deadline = self.utility.steps[-1][0]
        horizon = completion_s if completion_s > last_deadline else 2.0 * last_deadline
        self.utility = self.utility.with_horizon(horizon)
        log.info("utility: the last step is bridged to %s at T_0 = %.1f s", self.utility.after, horizon)

    def _evaluate(self, k: int, rates: Mapping[int, float], remaining: float, elapsed: float) -> dict[str, Any]:
        """R, T, U(T), remaining cost and net value at ``k`` workers."""
        rate = estimate_rate(rates, k)
        remaining_s = remaining / rate if rate > 0 else math.inf
        completion = elapsed + remaining_s
        utility = self.utility.value(completion)
        cost = self.price_per_worker_s * k * remaining_s
        return {
            "rate": rate,
            "estimated": k not in rates,
            "completion_s": completion,
            "utility": utility,
            "cost": cost,
            "net": utility - cost,
        }

    def _decision(
        self,
        current: int,
        target: int,
        values: dict[int, dict[str, Any]],
        rates: Mapping[int, float],
        remaining: float,
        elapsed: float,
    ) -> SizeDecision:
        here, there = values[current], values[target]
        gain = there["utility"] - here["utility"]
        extra = there["cost"] - here["cost"]
        verb = "add" if target > current else "remove"
        estimated = sorted(k for k, v in values.items() if v["estimated"])
        reason = (
            f"{verb} {_workers(abs(target - current))}, {current} -> {target}: utility {here['utility']:.4g} -> "
            f"{there['utility']:.4g} (T {here['completion_s']:.0f} s -> {there['completion_s']:.0f} s), "
            f"remaining cost {here['cost']:.4g} -> {there['cost']:.4g}; utility change {gain:.4g} > cost change "
            f"{extra:.4g}"
        )
        if estimated:
            reason += f" (rate at {_sizes_phrase(estimated)} estimated: {there['rate']:.4g} samples/s)"
        inputs = {
            "policy": "utility",
            "rates": {int(k): float(v) for k, v in sorted(rates.items())},
            "price_per_worker_s": self.price_per_worker_s,
            "remaining_samples": remaining,
            "elapsed_s": elapsed,
            "candidates": {int(k): dict(v) for k, v in sorted(values.items())},
            "estimated": estimated,
            "utility": self.utility.to_dict(),
        }
        return SizeDecision(target, reason, inputs)

    def _clamp(self, size: int) -> int:
        upper = self.max_workers if self.max_workers is not None else size
        return min(max(size, self.min_workers), upper)

    def to_dict(self) -> dict[str, Any]:
        return {
            "price_per_worker_s": self.price_per_worker_s,
            "utility": self.utility.to_dict(),
            "step": self.step,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UtilityAutoscaler:
        return cls(
            data["price_per_worker_s"],
            UtilityFunction.from_dict(data["utility"]),
            data.get("step", 1),
            data.get("min_workers", 1),
            data.get("max_workers"),
        )
