"""Scaling: the batch size and learning rate of a job at a resize, pure (no Lightning, no process group): the
throughput model, Elan's Algorithm 1 with its scale-in mirror and the user's limits, and the progressive linear LR
rule. What size a job should have is :mod:`lightning_elan.sizing`'s."""

from __future__ import annotations

from lightning_elan.scaling.batch import (
    POLICIES,
    ScalingDecision,
    ScalingLimits,
    scale_global_batch,
    shrink_global_batch,
    total_batch_size,
)
from lightning_elan.scaling.lr import LR_RULES, LRRamp, lr_factor, lr_scale, next_ramp
from lightning_elan.scaling.report import format_summary, scaling_summary
from lightning_elan.scaling.throughput import ThroughputModel
from lightning_elan.scaling.timing import StepSample, StepTimer

__all__ = [
    "LR_RULES",
    "POLICIES",
    "LRRamp",
    "ScalingDecision",
    "ScalingLimits",
    "StepSample",
    "StepTimer",
    "ThroughputModel",
    "format_summary",
    "lr_factor",
    "lr_scale",
    "next_ramp",
    "scale_global_batch",
    "scaling_summary",
    "shrink_global_batch",
    "total_batch_size",
]
