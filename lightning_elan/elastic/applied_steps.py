"""The optimizer steps a batch of manual optimization applied, kept until the batch stands.

With ``automatic_optimization = False`` a ``training_step`` may step several optimizers (a GAN's discriminator, then
its generator) or one several times. Each step is voted on by itself, but a batch is redone whole: when a member dies
after the batch's first step was committed and applied, the survivors put the parameters and optimizer state back to
the batch's start before they redo it, or the first step would be applied twice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Saved:
    optimizer: torch.optim.Optimizer
    parameters: list[torch.Tensor]
    state: dict[str, Any]


class AppliedSteps:
    """Snapshots of the optimizers a batch stepped, each taken before its first update in the batch."""

    def __init__(self) -> None:
        self._saved: list[_Saved] = []

    def __bool__(self) -> bool:
        return bool(self._saved)

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """The step of ``optimizer`` is committed and about to be applied: keep what it changes, once per batch."""
        if any(saved.optimizer is optimizer for saved in self._saved):
            return
        parameters = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        self._saved.append(_Saved(optimizer, parameters, copy.deepcopy(optimizer.state_dict())))

    def batch_stands(self) -> None:
        self._saved.clear()

    @torch.no_grad()
    def undo(self) -> None:
        """Parameters and optimizer state as at the batch's start (the latest-saved optimizer first)."""
        for saved in reversed(self._saved):
            live = [p for group in saved.optimizer.param_groups for p in group["params"]]
            for parameter, value in zip(live, saved.parameters, strict=True):
                parameter.copy_(value)
            saved.optimizer.load_state_dict(saved.state)
        self._saved.clear()
