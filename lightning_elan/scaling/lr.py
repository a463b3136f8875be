"""Progressive linear scaling of the learning rate (Elan, equations 2–3). Pure.

A ramp multiplies the user's (scheduled) learning rate by a factor that goes linearly from ``from_scale`` at step
``T0`` to ``to_scale`` at ``T0 + T`` and stays there: ``lr_t = lr_0 + (t − T0)/T · (lr_T − lr_0)`` with
``lr_T = k·lr_0`` (``"linear"``) or ``sqrt(k)·lr_0`` (``"sqrt"``). A new ramp starts from the factor in force at its
first step, so successive adjustments compose without a jump.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

LR_RULES: tuple[str, ...] = ("linear", "sqrt")


@dataclass(frozen=True)
class LRRamp:
    """Factor ``from_scale`` at ``start_step`` (T0), linear to ``to_scale`` at ``start_step + ramp_steps`` (T0 + T),
    then flat."""

    start_step: int
    ramp_steps: int
    from_scale: float
    to_scale: float

    def __post_init__(self) -> None:
        if self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be >= 0, got {self.ramp_steps}")
        if self.from_scale <= 0 or self.to_scale <= 0:
            raise ValueError(f"LR scales must be > 0, got {self.from_scale} -> {self.to_scale}")

    @property
    def end_step(self) -> int:
        return self.start_step + self.ramp_steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LRRamp:
        return cls(int(state["start_step"]), int(state["ramp_steps"]), float(state["from_scale"]),
                   float(state["to_scale"]))


def lr_scale(step: int, ramp: LRRamp | None) -> float:
    """The LR multiplier at optimizer step ``step`` (1 without a ramp)."""
    if ramp is None:
        return 1.0
    if step >= ramp.end_step:
        return ramp.to_scale
    if step <= ramp.start_step:
        return ramp.from_scale
    progress = (step - ramp.start_step) / ramp.ramp_steps
    return ramp.from_scale + progress * (ramp.to_scale - ramp.from_scale)


def lr_factor(k: float, rule: str = "linear") -> float:
    """LR multiplier for a global batch multiplied by ``k``: ``k`` (linear rule) or ``sqrt(k)``."""
    if rule not in LR_RULES:
        raise ValueError(f"lr_rule must be one of {LR_RULES}, got {rule!r}")
    if k <= 0:
        raise ValueError(f"batch factor must be > 0, got {k}")
    return k if rule == "linear" else math.sqrt(k)


def next_ramp(current: LRRamp | None, step: int, to_scale: float, ramp_steps: int) -> LRRamp:
    """A ramp starting at ``step`` from the multiplier ``current`` gives there, towards ``to_scale``."""
    return LRRamp(step, ramp_steps, lr_scale(step, current), to_scale)


class ScaledParamGroups:
    """The param groups of one optimizer (anything with ``param_groups``) while they hold scaled LRs: the values to
    put back after the step."""

    def __init__(self, optimizer: Any, scale: float) -> None:
        self.unscaled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self.unscaled, strict=True):
            group["lr"] = lr * scale
        self.scaled = [group["lr"] for group in optimizer.param_groups]

    def restore(self, optimizer: Any) -> None:
        for group, unscaled, scaled in zip(optimizer.param_groups, self.unscaled, self.scaled, strict=False):
            if group["lr"] is scaled:
                group["lr"] = unscaled
            else:  # someone set a new LR during the step: theirs is unscaled already
                log.debug("param group lr changed during the optimizer step; keeping %s", group["lr"])
