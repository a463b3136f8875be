"""Sizing: what size a running job should have, pure (no Lightning, no process group): the autoscaling policies
(throughput, utility), the profile run over a range of sizes, and the straggler detector. The AM applies them
(``master/sizing.py``); a resize request itself is a *scale* (``elan scale``), and the batch size and learning rate
at a resize are :mod:`lightning_elan.scaling`'s."""

from __future__ import annotations

from lightning_elan.sizing.autoscale import (
    SizeDecision,
    ThroughputAutoscaler,
    UtilityAutoscaler,
    UtilityFunction,
    estimate_rate,
    scaling_efficiency,
)
from lightning_elan.sizing.profile import ProfileRun
from lightning_elan.sizing.stragglers import StragglerDetector

__all__ = [
    "ProfileRun",
    "SizeDecision",
    "StragglerDetector",
    "ThroughputAutoscaler",
    "UtilityAutoscaler",
    "UtilityFunction",
    "estimate_rate",
    "scaling_efficiency",
]
