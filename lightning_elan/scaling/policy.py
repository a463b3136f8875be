"""ScalingPolicy: the framework-free core of hybrid scaling, shared by the Lightning callback and the Accelerate
integration (pure: no Lightning, no process group).

It owns the throughput model a worker learns from its own steps, the user's limits and LR rule, and the decision of
the last resize; ``HybridScaling`` (Lightning) and ``ElasticAccelerator`` (Accelerate) feed it step timings from their
hooks and register it with the elastic engine, whose ``ScalingLink`` calls :meth:`decide` on rank 0 and the
front-end's ``apply_resize`` on every member.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lightning_elan.scaling.batch import POLICIES, ScalingDecision, ScalingLimits, scale_global_batch
from lightning_elan.scaling.lr import LR_RULES, lr_factor
from lightning_elan.scaling.report import scaling_summary
from lightning_elan.scaling.throughput import ThroughputModel
from lightning_elan.scaling.timing import StepTimer

log = logging.getLogger(__name__)

__all__ = ["ScalingPolicy"]


class ScalingPolicy:
    """Strong, weak or Elan's hybrid scaling of the global batch when the job changes size (see ``HybridScaling``
    for the arguments)."""

    def __init__(
        self,
        policy: str = "strong",
        min_local_batch: int = 1,
        max_local_batch: int | None = None,
        max_global_batch: int | None = None,
        lr_rule: str = "linear",
        min_observations: int = 3,
        warmup_steps: int = 2,
        backward_ratio: float = 2.0,
        learn: bool = True,
        profile: str | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {LR_RULES}, got {lr_rule!r}")
        self.policy = policy
        self.limits = ScalingLimits(min_local_batch, max_local_batch, max_global_batch)
        self.lr_rule = lr_rule
        self.warmup_steps = warmup_steps
        self.learn = learn
        self.model = ThroughputModel(min_observations=min_observations)
        if profile is not None:
            self.model.load_state_dict(json.loads(Path(profile).read_text()))
        self.timer = StepTimer(backward_ratio)
        self.base_global_batch: int | None = None  # the batch the user's LR was tuned for
        self.global_batch: int | None = None
        self.world_size = 1
        self.last_decision: ScalingDecision | None = None
        self._skip = warmup_steps

    def decide(self, n_old: int, n_new: int, global_batch: int) -> ScalingDecision:
        """The global batch for ``n_old → n_new`` workers under the policy, with the LR multiplier to ramp to.

        Called on rank 0 at an adjustment; the engine broadcasts the result (``ScalingDecision.to_dict()``).
        """
        if self.base_global_batch is None:
            self.base_global_batch = global_batch
        decision = scale_global_batch(self.policy, n_old, n_new, global_batch, self.model, self.limits)
        target = lr_factor(decision.global_batch / self.base_global_batch, self.lr_rule)
        decision = ScalingDecision(decision.global_batch, decision.local_batch, decision.k, decision.reason, target)
        log.info("scaling %d -> %d workers: global batch %d -> %d (%s)", n_old, n_new, global_batch,
                 decision.global_batch, decision.reason)
        self.last_decision = decision
        return decision

    def decide_resize(self, n_old: int, n_new: int, global_batch: int) -> ScalingDecision:
        """The elastic engine's ``ScalingParticipant.decide_resize``."""
        return self.decide(n_old, n_new, global_batch)

    def record_decision(self, decision: ScalingDecision) -> None:
        """Every rank, when a decision arrived: it is the last one and sets the global batch."""
        if self.base_global_batch is None and decision.k > 0:
            self.base_global_batch = max(1, round(decision.global_batch / decision.k))
        self.last_decision = decision
        self.global_batch = decision.global_batch

    def summary(self) -> dict[str, Any]:
        """JSON-able, for ``elan status``: the fitted throughput per world size at the current and next global batch,
        and the last decision with its reason."""
        return scaling_summary(self.model, self.policy, self.global_batch, self.world_size, self.last_decision)

    def record_allreduce_time(self, seconds: float) -> None:
        """Optional: a measured all-reduce time for the step in flight (replaces the estimate from the timings)."""
        self.timer.allreduce(seconds)

    # ------------------------------------------------------------------ learning from steps

    def track_world_size(self, world_size: int) -> None:
        """The first steps in a new world are not measured (``warmup_steps``)."""
        if world_size != self.world_size:
            self.world_size, self._skip = world_size, self.warmup_steps

    def track_global_batch(self, global_batch: int | None) -> None:
        if global_batch is not None:
            self.global_batch = global_batch
        if self.base_global_batch is None:
            self.base_global_batch = self.global_batch

    def observe(self, local_batch: int, world_size: int, compute_s: float, allreduce_s: float) -> None:
        """One measured step of this worker (skipped during the warm-up after a world-size change)."""
        if self._skip > 0:
            self._skip -= 1
        elif self.learn:
            self.model.observe_step(local_batch, world_size, compute_s, allreduce_s)

    # ------------------------------------------------------------------ state (checkpoints and replication)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "backward_ratio": [self.timer.ratio.count, self.timer.ratio.mean],
            "base_global_batch": self.base_global_batch,
            "global_batch": self.global_batch,
            "last_decision": None if self.last_decision is None else self.last_decision.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict["model"])
        self.timer.ratio.count, self.timer.ratio.mean = state_dict["backward_ratio"]
        self.base_global_batch = state_dict.get("base_global_batch")
        self.global_batch = state_dict.get("global_batch")
        decision = state_dict.get("last_decision")
        self.last_decision = None if decision is None else ScalingDecision.from_dict(decision)
