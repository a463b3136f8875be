"""Accelerate's optimizer and scheduler wrappers, elastic: a step is committed by every member before it is applied,
the LR ramp scales the step, and the LR schedule does not depend on the world of the moment. They reach the
accelerator through :class:`StepCommit`, which it implements."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from typing_extensions import override

from lightning_elan.accelerate import compat

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from lightning_elan.scaling.lr import ScaledParamGroups

__all__ = ["ElasticOptimizer", "ElasticScheduler", "StepCommit"]


class StepCommit(Protocol):
    """What the wrappers ask of the accelerator at a synchronised step (``ElasticAccelerator`` implements it)."""

    @property
    def launch_world_size(self) -> int:
        """The LR schedule steps this many times per optimizer step, whatever the world of the moment."""

    @property
    def step_discarded(self) -> bool:
        """A member died during the current step: nothing of it is applied."""

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> tuple[bool, ScaledParamGroups | None]:
        """Commit the step with every member; whether to apply it, and the param groups to restore after it."""

    def after_optimizer_step(self) -> None:
        """The committed step was applied."""

    def step_with_closure(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                          step: Callable[[Callable[[], Any]], None]) -> None:
        """Run ``step`` (the optimizer's step) with ``closure`` (as it may be evaluated), then commit it; undo it if
        it is discarded."""


class ElasticOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` whose synchronised steps go through the elastic accelerator first."""

    def __init__(self, optimizer: Any, accelerator: StepCommit, device_placement: bool = True,
                 scaler: Any = None) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self.elastic_accelerator = accelerator

    @override
    def step(self, closure: Any = None) -> None:
        if not self.gradient_state.sync_gradients:
            return super().step(closure)
        if closure is not None:  # evaluated inside the step (L-BFGS: several times): voted on after it
            self.elastic_accelerator.step_with_closure(self.optimizer, closure,
                                                       lambda evaluate: AcceleratedOptimizer.step(self, evaluate))
            return None
        apply, scaled = self.elastic_accelerator.before_optimizer_step(self.optimizer)
        if not apply:
            return None  # the step is discarded (a member died): nothing is applied, the batch is redone
        try:
            super().step(closure)
        finally:
            if scaled is not None:
                scaled.restore(self.optimizer)
        self.elastic_accelerator.after_optimizer_step()

    @property
    @override
    def step_was_skipped(self) -> bool:
        """Skipped for a gradient overflow (mixed precision) or discarded because a member died during the step
        (so ``accelerator.optimizer_step_was_skipped`` tells a loop to leave the step's side effects out too)."""
        return self.elastic_accelerator.step_discarded or super().step_was_skipped


class ElasticScheduler(AcceleratedScheduler):
    """``AcceleratedScheduler`` stepping ``launch_world_size`` times per optimizer step (Accelerate steps it once per
    process of the world of the moment; with a changing world the schedule would change with it)."""

    def __init__(self, scheduler: Any, optimizers: Any, accelerator: StepCommit, **kwargs: Any) -> None:
        super().__init__(scheduler, optimizers, **kwargs)
        self.elastic_accelerator = accelerator

    @override
    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.elastic_accelerator.step_discarded:
            return
        with compat.reported_num_processes(self.elastic_accelerator.launch_world_size):
            super().step(*args, **kwargs)
