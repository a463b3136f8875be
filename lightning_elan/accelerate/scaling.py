"""Hybrid scaling for an Accelerate job: the engine's scaling participant, with the LR ramp it starts (pure torch)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_elan.accelerate.plugin import ElasticPlugin
from lightning_elan.scaling.batch import ScalingDecision
from lightning_elan.scaling.lr import LRRamp, lr_scale, next_ramp
from lightning_elan.scaling.policy import ScalingPolicy

log = logging.getLogger(__name__)

__all__ = ["AccelerateScaling"]


class AccelerateScaling:
    """Decides the global batch at a resize (``ScalingPolicy``) and ramps the LR to the decision's multiplier.

    ``next_step`` returns the index of the next optimizer step: the ramp's T0, where the old multiplier still holds.
    """

    def __init__(self, plugin: ElasticPlugin, next_step: Callable[[], int]) -> None:
        self.policy = ScalingPolicy(plugin.scaling, plugin.min_local_batch, plugin.max_local_batch,
                                    plugin.max_global_batch, plugin.lr_rule, profile=plugin.scaling_profile)
        self.ramp_steps = plugin.lr_ramp_steps
        self.ramp: LRRamp | None = None
        self._next_step = next_step

    @property
    def last_decision(self) -> ScalingDecision | None:
        return self.policy.last_decision

    def decide_resize(self, n_old: int, n_new: int, global_batch: int) -> ScalingDecision:
        return self.policy.decide(n_old, n_new, global_batch)

    def apply_resize(self, decision: ScalingDecision) -> None:
        self.policy.record_decision(decision)
        target = decision.lr_scale
        if target is None or (self.ramp is not None and self.ramp.to_scale == target):
            return
        self.ramp = next_ramp(self.ramp, self._next_step(), target, self.ramp_steps)
        log.info("LR ramp from x%g at step %d to x%g at step %d", self.ramp.from_scale, self.ramp.start_step,
                 target, self.ramp.end_step)

    def forget_global_batch(self) -> None:
        """The training loader was replaced before the first step (a retry at a smaller batch size): the global batch
        the user's LR was tuned for is the new loader's, recorded at its first batch."""
        self.policy.base_global_batch = self.policy.global_batch = None

    def lr_scale_at(self, step: int) -> float:
        return lr_scale(step, self.ramp)

    def summary(self) -> dict[str, Any]:
        return self.policy.summary()

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "ramp": None if self.ramp is None else self.ramp.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.ramp = None if state.get("ramp") is None else LRRamp.from_dict(state["ramp"])
