"""Accelerate's optimizer and scheduler wrappers, elastic: a step is committed by every member before it is applied,
the LR ramp scales the step, and the LR schedule does not depend on the world of the moment."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from typing_extensions import override

from lightning_elan.accelerate import compat

if TYPE_CHECKING:
    from lightning_elan.accelerate.accelerator import ElasticAccelerator

__all__ = ["ElasticOptimizer", "ElasticScheduler"]


class ElasticOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` whose synchronised steps go through the elastic accelerator first."""

    def __init__(self, optimizer: Any, accelerator: ElasticAccelerator, device_placement: bool = True,
                 scaler: Any = None) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self.elastic_accelerator = accelerator

    @override
    def step(self, closure: Any = None) -> None:
        if not self.gradient_state.sync_gradients:
            return super().step(closure)
        apply, scaled = self.elastic_accelerator._before_optimizer_step(self.optimizer)
        if not apply:
            return None  # the step is discarded (a member died): nothing is applied, the batch is redone
        try:
            super().step(closure)
        finally:
            if scaled is not None:
                scaled.restore(self.optimizer)


    @property
    @override
    def step_was_skipped(self) -> bool:
        """Skipped for a gradient overflow (mixed precision) or discarded because a member died during the step
        (so ``accelerator.optimizer_step_was_skipped`` tells a loop to leave the step's side effects out too)."""
        return self.elastic_accelerator.step_discarded or super().step_was_skipped


class ElasticScheduler(AcceleratedScheduler):
    """``AcceleratedScheduler`` stepping ``launch_world_size`` times per optimizer step (Accelerate steps it once per
    process of the world of the moment; with a changing world the schedule would change with it)."""

    def __init__(self, scheduler: Any, optimizers: Any, accelerator: ElasticAccelerator, **kwargs: Any) -> None:
        super().__init__(scheduler, optimizers, **kwargs)
        self.elastic_accelerator = accelerator

    @override
    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.elastic_accelerator.step_discarded:
            return
        with compat.reported_num_processes(self.elastic_accelerator.launch_world_size):
            super().step(*args, **kwargs)
