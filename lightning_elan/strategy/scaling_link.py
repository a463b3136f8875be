"""The strategy's side of hybrid scaling: decide on rank 0, apply on every rank, tell the application master.

At an adjustment ``n_old → n_new`` rank 0 asks the job's :class:`~lightning_elan.callbacks.HybridScaling` for the new
global batch (:meth:`ScalingLink.decide`); the decision travels with the plan in rank 0's broadcast, and every old
member applies it (:meth:`ScalingLink.apply`) at the same batch boundary, *before* the sources snapshot the training
state, so joiners receive the new data position and the started LR ramp with the callbacks' state. Without a
``HybridScaling`` callback nothing is decided and the global batch stays (strong scaling).

The AM learns the outcome twice, off the hot path: every member's adjustment report carries the global batch it
applied and the decision (the adjustment record checks they agree), and rank 0 sends the callback's summary (fitted
throughput per world size, last decision) with a ``coordinate`` now and then, for ``elan status``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_elan import compat
from lightning_elan.scaling.batch import ScalingDecision

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elan.callbacks.hybrid import HybridScaling
    from lightning_elan.data.sampler import DataPosition

log = logging.getLogger(__name__)

SUMMARY_EVERY_S = 5.0
"""Rank 0 sends the scaling summary with a ``coordinate`` at most this often (and right after an adjustment)."""


def find_hybrid_scaling(trainer: pl.Trainer) -> HybridScaling | None:
    # imported here: the callbacks import Lightning, whose import hook registers this strategy (a cycle at import time)
    from lightning_elan.callbacks.hybrid import HybridScaling

    return next((callback for callback in trainer.callbacks if isinstance(callback, HybridScaling)), None)


class ScalingLink:
    """Connects :class:`~lightning_elan.callbacks.HybridScaling` to the elastic runtime (no collective of its own)."""

    def __init__(self, summary_every_s: float = SUMMARY_EVERY_S) -> None:
        self.summary_every_s = summary_every_s
        self._summary_sent_at: float | None = None

    # ------------------------------------------------------------------ at an adjustment

    def decide(self, trainer: pl.Trainer, plan: Mapping[str, Any], global_batch: int | None) -> dict[str, Any] | None:
        """Rank 0: the decision for this plan (JSON-able), or None without ``HybridScaling`` (strong scaling)."""
        scaling = find_hybrid_scaling(trainer)
        if scaling is None or global_batch is None:
            return None
        decision = scaling.decide(n_old=trainer.world_size, n_new=len(plan["members"]), global_batch=global_batch)
        return decision.to_dict()

    def apply(self, trainer: pl.Trainer, data: DataPosition, decision: Mapping[str, Any] | None) -> None:
        """Every old member, before the snapshot: the new global batch from this position on, and the LR ramp from
        the next optimizer step (``trainer.global_step``)."""
        if decision is None:
            return
        chosen = ScalingDecision.from_dict(dict(decision))
        _check_position(trainer, data)
        old = data.global_batch
        data.change_global_batch(chosen.global_batch)
        scaling = find_hybrid_scaling(trainer)
        if scaling is not None:
            scaling.apply(trainer, chosen)
        self._summary_sent_at = None  # the next coordinate shows the new decision
        log.info("global batch %s -> %d from step %d (lr x%s): %s", old, chosen.global_batch, trainer.global_step,
                 chosen.lr_scale, chosen.reason)

    # ------------------------------------------------------------------ what the AM hears

    def summary_if_due(self, trainer: pl.Trainer, now: float | None = None) -> dict[str, Any] | None:
        """Rank 0, at a coordinate: the scaling summary for ``elan status`` when it is due, else None."""
        scaling = find_hybrid_scaling(trainer)
        if scaling is None:
            return None
        now = time.monotonic() if now is None else now
        if self._summary_sent_at is not None and now - self._summary_sent_at < self.summary_every_s:
            return None
        self._summary_sent_at = now
        return scaling.summary()

    def report_fields(self, trainer: pl.Trainer, data: DataPosition) -> dict[str, Any]:
        """Added to this worker's adjustment report: the global batch it trains with and the decision it applied."""
        fields: dict[str, Any] = {"global_batch": data.global_batch}
        scaling = find_hybrid_scaling(trainer)
        if scaling is not None and scaling.last_decision is not None:
            fields["scaling"] = scaling.last_decision.to_dict()
        return {name: value for name, value in fields.items() if value is not None}


def _check_position(trainer: pl.Trainer, data: DataPosition) -> None:
    """The data position counts the same batches as Lightning's epoch loop (else the epoch would end early or late)."""
    ready = compat.batches_ready_in_epoch(trainer)
    if ready is not None and data.global_batch is not None and data.steps_done() != ready:
        log.error("data position %s counts %d batches in this epoch, Lightning %d", data, data.steps_done(), ready)
