"""Step timestamps and phase clocks, for the pause an adjustment costs (pure)."""

from __future__ import annotations

import statistics
import time
from collections import deque


class StepTimeline:
    """Keeps recent step durations and measures the pause around an adjustment."""

    def __init__(self, window: int = 32) -> None:
        self._durations: deque[float] = deque(maxlen=window)
        self._last_end: float | None = None
        self._adjust_start: float | None = None

    def step_ended(self, now: float | None = None) -> float | None:
        """Record the end of a step; returns the pause if this step was the first after an adjustment."""
        now = time.perf_counter() if now is None else now
        pause = None
        if self._adjust_start is not None:
            pause = max(0.0, now - self._adjust_start - self.typical_step())
            self._adjust_start = None
        elif self._last_end is not None:
            self._durations.append(now - self._last_end)
        self._last_end = now
        return pause

    def adjustment_started(self) -> None:
        """The adjustment begins at the end of the step just recorded."""
        self._adjust_start = self._last_end if self._last_end is not None else time.perf_counter()

    def typical_step(self) -> float:
        return statistics.median(self._durations) if self._durations else 0.0


class PhaseClock:
    """Milliseconds spent in each named phase, for the adjustment log line."""

    def __init__(self, since: float | None = None) -> None:
        self._last = time.perf_counter() if since is None else since
        self._phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases.append((phase, (now - self._last) * 1e3))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in self._phases)
