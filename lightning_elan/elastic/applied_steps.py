"""The optimizer steps a batch of manual optimization applied, kept until the batch stands.

With ``automatic_optimization = False`` a ``training_step`` may step several optimizers (a GAN's discriminator, then
its generator) or one several times. Each step is voted on by itself, but a batch is redone whole: when a member dies
after the batch's first step was committed and applied, the survivors put the parameters and optimizer state back to
the batch's start before they redo it, or the first step would be applied twice. An optimizer that evaluates its
closure several times in one step (``torch.optim.LBFGS``: forward, backward and a gradient all-reduce per evaluation,
the parameters updated between them) is kept the same way until its step returns (:class:`ClosureReevaluations`).
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
        """A step of ``optimizer`` is about to begin in this batch: keep what it may change, once per batch."""
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


class ClosureReevaluations:
    """Which optimizers evaluate the closure more than once per step: ``torch.optim.LBFGS`` from the start, any other
    from the first step it was seen doing so (its closure evaluations counted by the strategy)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def expected(self, optimizer: torch.optim.Optimizer) -> bool:
        return isinstance(optimizer, torch.optim.LBFGS) or id(optimizer) in self._seen

    def seen(self, optimizer: torch.optim.Optimizer, evaluations: int) -> None:
        if evaluations > 1:
            self._seen.add(id(optimizer))
