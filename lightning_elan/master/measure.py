"""What the AM measures of a running job: throughput per world size and each member's compute time (pure).

Throughput comes from rank 0's ``coordinate`` requests: each carries the optimizer step and the global batch, and the
AM stamps its arrival. Within one generation, the samples trained between two coordinates over the time between them
is the job's rate at that world size; the interval that holds a generation's first step (the adjustment's pause and
the slower first step after it) is never counted — a generation's first coordinate is only its baseline.
Compute time per step comes from each member's ``worker_stats`` (its forward passes, see ``elastic/compute.py``); a
*round* is complete when every member has reported since the last round, and it feeds the straggler detector.
Everything here is informational: persisted with the job's state but never a reason to write it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elan.sizing.stragglers import StragglerDetector


@dataclass
class Interval:
    """Samples, seconds and steps measured at one world size."""

    samples: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    @property
    def rate(self) -> float | None:
        return self.samples / self.seconds if self.seconds > 0 and self.steps > 0 else None

    def add(self, samples: float, seconds: float, steps: int) -> None:
        self.samples, self.seconds, self.steps = self.samples + samples, self.seconds + seconds, self.steps + steps


@dataclass
class Measurements:
    """Throughput per world size (all generations of that size, and the current generation alone) and compute."""

    sizes: dict[int, Interval] = field(default_factory=dict)
    current: Interval = field(default_factory=Interval)  # the current generation, after its baseline
    generation: int | None = None
    world_size: int | None = None
    last_step: int | None = None
    last_at: float | None = None
    compute: dict[str, float] = field(default_factory=dict)  # member → mean compute s/step, this generation
    compute_history: dict[int, dict[str, float]] = field(default_factory=dict)  # world size → member → compute
    unreported: list[str] = field(default_factory=list)  # members without stats since the last straggler round
    detector: StragglerDetector = field(default_factory=StragglerDetector, compare=False)  # its state: to_dict()

    def observe_coordinate(self, generation: int, world_size: int, step: int, global_batch: int | None,
                           now: float) -> None:
        """Rank 0 coordinated at ``step`` (``global_batch`` samples per step) at time ``now``."""
        if generation != self.generation or self.last_step is None or self.last_at is None:
            self._new_generation(generation, world_size, step, now)
            return
        steps, seconds = step - self.last_step, now - self.last_at
        if steps > 0 and seconds > 0 and global_batch:
            self.current.add(steps * global_batch, seconds, steps)
            self.sizes.setdefault(world_size, Interval()).add(steps * global_batch, seconds, steps)
        self.last_step, self.last_at = max(step, self.last_step), now

    def _new_generation(self, generation: int, world_size: int, step: int, now: float) -> None:
        self.generation, self.world_size, self.last_step, self.last_at = generation, world_size, step, now
        self.current = Interval()
        self.compute = {}

    def rates(self) -> dict[int, float]:
        """Samples/s per world size measured so far."""
        return {size: rate for size, interval in sorted(self.sizes.items()) if (rate := interval.rate) is not None}

    def observe_compute(self, worker_id: str, generation: int, compute_s: float, members: list[str]) -> list[str]:
        """A member's mean compute time per step; returns the stragglers when this report completes a round."""
        if generation != self.generation:
            return self.detector.stragglers()
        self.compute[worker_id] = compute_s
        if self.world_size is not None:
            self.compute_history.setdefault(self.world_size, {})[worker_id] = compute_s
        if not self.unreported or any(worker not in members for worker in self.unreported):
            self.unreported = list(members)
        if worker_id in self.unreported:
            self.unreported.remove(worker_id)
        if self.unreported or len(members) < 2:
            return self.detector.stragglers()
        self.detector.forget(members)
        return self.detector.observe({worker: self.compute[worker] for worker in members if worker in self.compute})

    def slowest_compute(self, world_size: int) -> float | None:
        """The slowest member's compute seconds per step last measured at ``world_size``."""
        measured = self.compute_history.get(world_size)
        return max(measured.values()) if measured else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": {str(size): asdict(interval) for size, interval in self.sizes.items()},
            "current": asdict(self.current), "generation": self.generation, "world_size": self.world_size,
            "last_step": self.last_step, "last_at": self.last_at, "compute": dict(self.compute),
            "compute_history": {str(size): dict(c) for size, c in self.compute_history.items()},
            "unreported": list(self.unreported), "detector": self.detector.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Measurements:
        if not data:
            return cls()
        return cls(
            sizes={int(size): Interval(**interval) for size, interval in data.get("sizes", {}).items()},
            current=Interval(**data.get("current", {})), generation=data.get("generation"),
            world_size=data.get("world_size"), last_step=data.get("last_step"), last_at=data.get("last_at"),
            compute=dict(data.get("compute", {})),
            compute_history={int(size): dict(c) for size, c in data.get("compute_history", {}).items()},
            unreported=list(data.get("unreported", [])),
            detector=StragglerDetector.from_dict(data["detector"]) if data.get("detector") else StragglerDetector(),
        )

    def summary(self) -> dict[str, Any]:
        """For ``elan status``: samples/s per world size, this generation's, and the straggler scores."""
        return {
            "samples_per_s": {str(size): round(rate, 3) for size, rate in self.rates().items()},
            "current": {"world_size": self.world_size, "steps": self.current.steps,
                        "samples_per_s": None if self.current.rate is None else round(self.current.rate, 3)},
            "compute_s": {worker: round(seconds, 6) for worker, seconds in self.compute.items()},
            "straggler_scores": {worker: round(score, 3) for worker, score in self.detector.scores().items()},
            "stragglers": self.detector.stragglers(),
        }
