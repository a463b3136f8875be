"""Standby workers (``elan run --standby K``): joiners started ahead of any request, warmed up and waiting.

A standby is a pending worker of no request (its ``request_id`` is :data:`STANDBY_REQUEST`). It starts like any
joiner — imports, model, optimizer, data loader — reports ready and long-polls for a plan; the AM answers it
``standby`` (wait on, with no deadline). An ``add`` takes standbys before it starts new processes, ready ones first,
so the request is ready as soon as it is queued and the next coordination adjusts; the pool is then refilled with new
processes. Pure bookkeeping: the statuses live in the job state's pending workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elan.protocol.contract import MAX_STANDBY, STANDBY_REQUEST

__all__ = ["STANDBY_REQUEST", "StandbyPool"]


@dataclass
class StandbyPool:
    """How many standbys the job keeps (``target``) and which workers are in the pool, oldest first."""

    target: int = 0
    workers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.target <= MAX_STANDBY:
            raise ValueError(f"the standby pool holds 0 to {MAX_STANDBY} workers, got {self.target}")

    def missing(self) -> int:
        """Workers to start to bring the pool back to its target."""
        return max(0, self.target - len(self.workers))

    def take(self, count: int, readiness: Callable[[str], int]) -> list[str]:
        """Up to ``count`` workers out of the pool: the most ready first (``readiness``: higher is readier), the
        oldest among equals."""
        ranked = sorted(self.workers, key=lambda worker: -readiness(worker))  # stable: oldest first among equals
        taken = ranked[:max(0, count)]
        self.workers = [worker for worker in self.workers if worker not in taken]
        return taken

    def discard(self, worker_id: str) -> bool:
        """Forget a standby (it exited, or was stopped); returns whether it was in the pool."""
        if worker_id not in self.workers:
            return False
        self.workers.remove(worker_id)
        return True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StandbyPool:
        return cls(**data) if data else cls()
