"""What the AM remembers of sizing, durably, in the job's state: what it was asked, how far it got, what it decided.

:mod:`lightning_elan.master.sizing` makes the decisions; ``JobState.sizing`` holds this record and persists it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MAX_DECISIONS", "SizingState"]

MAX_DECISIONS = 50


@dataclass
class SizingState:
    """The durable part: what the AM was asked to do, how far it got, and the decisions it made."""

    profile: dict[str, Any] | None = None  # {"run": ProfileRun, "measured": {size: rate}, "started_at"}
    profile_result: dict[str, Any] | None = None  # the last finished profile
    autoscale: dict[str, Any] | None = None  # {"policy", "config", "state", "last_size_at"}
    stragglers: dict[str, Any] = field(default_factory=lambda: {"mode": "off"})
    replacing: dict[str, Any] | None = None  # {"straggler", "request_id", "size"}: a replacement under way
    scale_out_command: str | None = None
    scale_out: dict[str, Any] | None = None  # {"target", "at"}: the last time the scale-out command was run
    decisions: list[dict[str, Any]] = field(default_factory=list)  # the last MAX_DECISIONS, oldest first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SizingState:
        return cls(**data) if data else cls()

    def note(self, kind: str, decision: str, reason: str, inputs: dict[str, Any], now: float) -> dict[str, Any]:
        """Record one decision (also those that change nothing); returns the record."""
        record = {"at": now, "kind": kind, "decision": decision, "reason": reason, "inputs": inputs}
        self.decisions = [*self.decisions, record][-MAX_DECISIONS:]
        logger.info("sizing: %s → %s: %s", kind, decision, reason)
        return record

    def summary(self) -> dict[str, Any]:
        return {
            "profile": None if self.profile is None else {key: self.profile[key] for key in ("run", "measured")},
            "profile_result": self.profile_result,
            "autoscale": None if self.autoscale is None else {
                "policy": self.autoscale["policy"], "config": self.autoscale["config"]},
            "stragglers": {key: value for key, value in self.stragglers.items() if key != "detector"},
            "replacing": self.replacing,
            "decisions": self.decisions[-10:],
        }
