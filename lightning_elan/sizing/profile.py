"""EDL's ``profile(job, min_p, max_p)`` (Wu et al., §3.1 and §5.2) on a live job, pure (no Lightning, no process
group): which sizes to visit, in which order, and where to settle.

EDL starts a profiling job at the maximum parallelism and scales in one GPU at a time to the minimum, measuring each
size for a few mini-batches (10 in its §6.2): scaling in only pauses the stayers, scaling out starts processes. A live
job starts wherever it is, so it keeps both properties — scale-ins of one worker, a single scale-out: it is measured
where it is, scales in one worker at a time down to ``min_size``, grows to ``max_size`` in one request, then scales
in one worker at a time down to the size above its start (from 2 in ``[1, 3]``: 2 → 1 → 3 → 2; from 3: 3 → 2 → 1 →
3). Growing to the top first would cross the start size on the way down and need a second scale-out to return. A
job outside the range enters it at the top; a size already measured (after an outside resize) is skipped, and
a size the job finds itself at unmeasured is measured there. ``steps`` is how many steps the caller measures at each
size. Once every size in [min, max] is measured the job settles: back at ``start_size`` (``settle="return"``) or at
the highest measured throughput, the smaller size on a tie (``settle="best"``); :meth:`result` reports the rates, the
per-worker rates, and the best size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SETTLE_MODES", "ProfileRun"]

SETTLE_MODES = ("return", "best")


class ProfileRun:
    """EDL's profile(min_p, max_p) on a live job: the sizes to visit and where to settle."""

    def __init__(self, min_size: int, max_size: int, start_size: int, steps: int = 20, settle: str = "return") -> None:
        if min_size < 1:
            raise ValueError(f"min_size must be >= 1, got {min_size}")
        if min_size > max_size:
            raise ValueError(f"min_size ({min_size}) must be <= max_size ({max_size})")
        if start_size < 1:
            raise ValueError(f"start_size must be >= 1, got {start_size}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if settle not in SETTLE_MODES:
            raise ValueError(f"settle must be one of {SETTLE_MODES}, got {settle!r}")
        self.min_size = min_size
        self.max_size = max_size
        self.start_size = start_size
        self.steps = steps
        self.settle = settle
        self._done = False

    @property
    def sizes(self) -> list[int]:
        """The sizes to profile, in visiting order: the start (when in range), one fewer at a time down to min, then
        max and one fewer at a time down to just above the start."""
        descending = range(self.max_size, self.min_size - 1, -1)
        start = [self.start_size] if self.min_size <= self.start_size <= self.max_size else []
        below = [size for size in descending if size < self.start_size]
        above = [size for size in descending if size > self.start_size]
        return start + below + above

    def route(self) -> list[int]:
        """Every size the job is at, in order, from the start to where it settles (``settle="return"``; with
        ``"best"`` the last size depends on the measurements and is left out)."""
        visits = [size for size in self.sizes if size != self.start_size]
        return [self.start_size, *visits, *([self.start_size] if self.settle == "return" and visits else [])]

    @property
    def done(self) -> bool:
        """Whether :meth:`next_target` has seen every size measured and the job at its final size."""
        return self._done

    def remaining(self, measured: Mapping[int, float]) -> list[int]:
        """Sizes in range still to measure, in visiting order."""
        done = {int(size) for size in measured}  # JSON turns the sizes into strings
        return [size for size in self.sizes if size not in done]

    def next_target(self, current: int, measured: Mapping[int, float]) -> int | None:
        """The size to move to next; None while ``current`` still needs measuring, or once done."""
        todo = self.remaining(measured)
        if current in todo:
            return None  # measure it where it is, whatever brought it there
        target = todo[0] if todo else self.final_size(measured)
        if target == current:
            self._done = not todo
            return None
        return target

    def final_size(self, measured: Mapping[int, float]) -> int:
        """Where the job settles: ``start_size``, or the best measured size in range (the smaller on a tie)."""
        if self.settle == "return":
            return self.start_size
        return self.best(measured) or self.start_size

    def best(self, measured: Mapping[int, float]) -> int | None:
        """The size in range with the highest measured throughput, the smaller on a tie; None if none measured."""
        rates = self._in_range(measured)
        if not rates:
            return None
        return max(sorted(rates), key=lambda size: rates[size])  # max keeps the first (smallest) of equals

    def finished(self, current: int, measured: Mapping[int, float]) -> bool:
        """Every size measured and the job at its final size."""
        return not self.remaining(measured) and current == self.final_size(measured)

    def result(self, measured: Mapping[int, float]) -> dict[str, Any]:
        """{"rates": {size: samples/s}, "per_worker": {size: samples/s per worker}, "best", "complete", ...}."""
        rates = self._in_range(measured)
        return {
            "min_size": self.min_size,
            "max_size": self.max_size,
            "rates": rates,
            "per_worker": {size: rate / size for size, rate in rates.items()},
            "best": self.best(measured),
            "best_rate": rates[self.best(measured)] if rates else None,
            "complete": not self.remaining(measured),
            "settle": self.settle,
            "final_size": self.final_size(measured),
        }

    def _in_range(self, measured: Mapping[int, float]) -> dict[int, float]:
        rates = {int(size): float(rate) for size, rate in measured.items()}
        return {size: rates[size] for size in sorted(rates) if self.min_size <= size <= self.max_size}

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_size": self.min_size,
            "max_size": self.max_size,
            "start_size": self.start_size,
            "steps": self.steps,
            "settle": self.settle,
            "done": self._done,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileRun:
        run = cls(
            data["min_size"], data["max_size"], data["start_size"], data.get("steps", 20), data.get("settle", "return")
        )
        run._done = bool(data.get("done", False))
        return run
