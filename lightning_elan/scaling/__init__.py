"""Scaling math, pure (no Lightning, no process group): the throughput model, Elan's Algorithm 1 with its scale-in
mirror and the user's limits, and the progressive linear LR rule."""

from __future__ import annotations

from lightning_elan.scaling.autoscale import (
    SizeDecision,
    ThroughputAutoscaler,
    UtilityAutoscaler,
    UtilityFunction,
    estimate_rate,
    scaling_efficiency,
)
from lightning_elan.scaling.batch import (
    POLICIES,
    ScalingDecision,
    ScalingLimits,
    scale_global_batch,
    shrink_global_batch,
    total_batch_size,
)
from lightning_elan.scaling.lr import LR_RULES, LRRamp, lr_factor, lr_scale, next_ramp
from lightning_elan.scaling.profile import ProfileRun
from lightning_elan.scaling.report import format_summary, scaling_summary
from lightning_elan.scaling.stragglers import StragglerDetector
from lightning_elan.scaling.throughput import ThroughputModel
from lightning_elan.scaling.timing import StepSample, StepTimer

__all__ = [
    "LR_RULES",
    "POLICIES",
    "LRRamp",
    "ProfileRun",
    "ScalingDecision",
    "ScalingLimits",
    "SizeDecision",
    "StepSample",
    "StepTimer",
    "StragglerDetector",
    "ThroughputAutoscaler",
    "ThroughputModel",
    "UtilityAutoscaler",
    "UtilityFunction",
    "estimate_rate",
    "format_summary",
    "lr_factor",
    "lr_scale",
    "next_ramp",
    "scale_global_batch",
    "scaling_efficiency",
    "scaling_summary",
    "shrink_global_batch",
    "total_batch_size",
]
