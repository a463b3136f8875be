"""The engine's side of hybrid scaling: ask whoever registered for the decision, apply it, tell the AM (pure).

At a resize ``n_old → n_new`` rank 0 asks the registered :class:`~lightning_elan.elastic.frontend.ScalingParticipant`
(``HybridScaling``) for the new global batch; the decision travels in rank 0's broadcast with the plan, and every old
member applies it *before* the state snapshot, so joiners receive the new data position and the started LR ramp.
Without a participant nothing is decided and the global batch stays (strong scaling).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from lightning_elan.data.sampler import DataPosition
from lightning_elan.elastic.frontend import ScalingParticipant
from lightning_elan.scaling.batch import ScalingDecision

log = logging.getLogger(__name__)

SUMMARY_EVERY_S = 5.0
"""Rank 0 sends the scaling summary with a ``coordinate`` at most this often (and right after a decision)."""


class ScalingLink:
    """Connects the registered scaling participant to the adjustment sequence (no collective of its own)."""

    def __init__(self, summary_every_s: float = SUMMARY_EVERY_S) -> None:
        self.participant: ScalingParticipant | None = None
        self.summary_every_s = summary_every_s
        self._summary_sent_at: float | None = None

    def decide(self, n_old: int, n_new: int, global_batch: int | None) -> dict[str, Any] | None:
        """Rank 0: the decision for this resize (JSON-able), or None (strong scaling)."""
        if self.participant is None or global_batch is None:
            return None
        return self.participant.decide_resize(n_old, n_new, global_batch).to_dict()

    def apply(self, data: DataPosition, decision: Mapping[str, Any] | None) -> None:
        """Every old member, before the snapshot: the new global batch from this position on, then the participant's
        own part (the LR ramp from the next optimizer step)."""
        if decision is None or self.participant is None:
            return
        chosen = ScalingDecision.from_dict(dict(decision))
        old = data.global_batch
        data.change_global_batch(chosen.global_batch)
        self.participant.apply_resize(chosen)
        self._summary_sent_at = None  # the next coordinate shows the new decision
        log.info("global batch %s -> %d (lr x%s): %s", old, chosen.global_batch, chosen.lr_scale, chosen.reason)

    def summary_if_due(self, now: float | None = None) -> dict[str, Any] | None:
        """Rank 0, at a coordinate: the scaling summary for ``elan status`` when it is due, else None."""
        if self.participant is None:
            return None
        now = time.monotonic() if now is None else now
        if self._summary_sent_at is not None and now - self._summary_sent_at < self.summary_every_s:
            return None
        self._summary_sent_at = now
        return self.participant.summary()

    def last_decision(self) -> dict[str, Any] | None:
        """The decision this worker applied last, for its adjustment report."""
        last = self.participant.last_decision if self.participant is not None else None
        return None if last is None else last.to_dict()
