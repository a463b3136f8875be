"""Persistent-straggler detection, pure (no Lightning, no process group): Or et al. (MLSys 2020) §5, Algorithm 1,
with EDL's (Wu et al., §5.2) "consistently slower in a few consecutive mini-batches" as the check window.

Each round gives every current worker's mean compute seconds per step over the same interval. A worker's throughput
is 1 / compute_s, its fraction is that throughput over the median of the round's throughputs, and its score is the
EWMA of the fraction, ``alpha * fraction + (1 - alpha) * score`` starting at 1.0 (Algorithm 1, alpha = 0.1, threshold
0.8). Algorithm 1 tests ``score < threshold`` every N steps; like EDL (slower than the median "for 10 mini-batches")
we require it on ``window`` consecutive rounds, so a single dip of the average is not enough (window = 1 is Or et
al.'s test as such). A constant fraction f < threshold is flagged after
``n0 + window - 1`` rounds, n0 the first n with ``1 - (1 - f)(1 - (1 - alpha)^n) < threshold``; f >= threshold never
(``rounds_to_flag``). A worker whose score recovers is no longer a straggler.

The median: with an odd number of workers it is the middle throughput; with an even number we take the upper of the
two middle ones (``statistics.median_high``), not their mean. With 2 workers the reference is then the faster one, and
the threshold keeps its meaning (at most 1/threshold slowdown, 1.25x at 0.8): with the mean, a worker at 0.7 of its
peer would score 0.7 / 0.85 = 0.82 and pass. With 3 workers the middle one is the reference, so if two of three are
slow they are the norm and only the fast one stands out (above 1, never flagged). Rounds with fewer than 2 usable
measurements are skipped (a lone worker has nothing to be compared with). Workers missing from a round, or with a
non-positive or non-finite time, keep their score and streak unchanged until ``forget``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["StragglerDetector"]


class StragglerDetector:
    """EWMA of each worker's throughput relative to the median; a straggler after ``window`` rounds below threshold."""

    def __init__(self, alpha: float = 0.1, threshold: float = 0.8, window: int = 5) -> None:
        _validate(alpha, threshold, window)
        self.alpha = alpha
        self.threshold = threshold
        self.window = window
        self.rounds = 0  # rounds that counted (2 or more usable measurements)
        self._scores: dict[str, float] = {}
        self._below: dict[str, int] = {}  # consecutive counted rounds with the score below threshold

    def observe(self, compute_s: Mapping[str, float]) -> list[str]:
        """One round of mean compute seconds per step by worker; the stragglers after it (sorted)."""
        usable = {w: float(s) for w, s in compute_s.items() if math.isfinite(s) and s > 0}
        skipped = sorted(set(compute_s) - set(usable))
        if skipped:
            log.debug("no usable compute time this round for %s", skipped)
        if len(usable) < 2:
            return self.stragglers()
        self.rounds += 1
        throughputs = {w: 1.0 / s for w, s in usable.items()}
        median = statistics.median_high(throughputs.values())
        for worker, throughput in throughputs.items():
            self._update(worker, throughput / median)
        return self.stragglers()

    def _update(self, worker: str, fraction: float) -> None:
        """Fold one fraction into the worker's EWMA and its below-threshold streak."""
        score = self.alpha * fraction + (1.0 - self.alpha) * self._scores.get(worker, 1.0)
        self._scores[worker] = score
        self._below[worker] = self._below.get(worker, 0) + 1 if score < self.threshold else 0

    def scores(self) -> dict[str, float]:
        """The current EWMA of each known worker's throughput fraction."""
        return dict(self._scores)

    def streaks(self) -> dict[str, int]:
        """Consecutive rounds each known worker's score has been below the threshold."""
        return dict(self._below)

    def stragglers(self) -> list[str]:
        """Known workers below the threshold for ``window`` consecutive rounds, sorted."""
        return sorted(w for w, n in self._below.items() if n >= self.window)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every worker not in ``keep`` (gone from the job, or replaced)."""
        keep = set(keep)
        for worker in [w for w in self._scores if w not in keep]:
            del self._scores[worker]
            self._below.pop(worker, None)

    @staticmethod
    def rounds_to_flag(fraction: float, alpha: float, threshold: float, window: int) -> int | None:
        """Rounds a worker at a constant ``fraction`` (others at the median) needs to be flagged; None: never."""
        _validate(alpha, threshold, window)
        if fraction >= threshold:
            return None  # the EWMA tends to ``fraction`` from above and never crosses the threshold
        n = _first_below(fraction, alpha, threshold)
        return n + window - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "threshold": self.threshold,
            "window": self.window,
            "rounds": self.rounds,
            "workers": {w: {"score": self._scores[w], "below": self._below.get(w, 0)} for w in sorted(self._scores)},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StragglerDetector:
        detector = cls(data["alpha"], data["threshold"], data["window"])
        detector.rounds = int(data.get("rounds", 0))
        for worker, state in data.get("workers", {}).items():
            detector._scores[worker] = float(state["score"])
            detector._below[worker] = int(state["below"])
        return detector


def _validate(alpha: float, threshold: float, window: int) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _ewma_after(fraction: float, alpha: float, n: int) -> float:
    """Closed form of the EWMA after n rounds at ``fraction`` from 1.0: 1 - (1 - f)(1 - (1 - alpha)^n)."""
    return 1.0 - (1.0 - fraction) * (1.0 - (1.0 - alpha) ** n)


def _first_below(fraction: float, alpha: float, threshold: float) -> int:
    """The first n with the EWMA below threshold, for fraction < threshold: (1 - alpha)^n < (T - f) / (1 - f)."""
    if alpha == 1.0:
        return 1
    bound = (threshold - fraction) / (1.0 - fraction)
    n = max(1, math.ceil(math.log(bound) / math.log(1.0 - alpha)))
    while n > 1 and _ewma_after(fraction, alpha, n - 1) < threshold:  # guard the logarithms' rounding
        n -= 1
    while _ewma_after(fraction, alpha, n) >= threshold:
        n += 1
    return n
