"""ProgressiveLinearLR: Elan's LR ramp as a multiplier applied only while the optimizer steps.

``on_before_optimizer_step`` (inside ``optimizer.step``: Lightning evaluates the closure there) multiplies every
param group's ``lr`` by the ramp's factor; a step post-hook registered on the optimizer puts the unscaled value back
right after the update. Schedulers (stepped after the optimizer) and checkpoints therefore only ever see the unscaled
LR, so the ramp composes with any scheduler, closed-form or chainable.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elan.scaling.lr import LRRamp, ScaledParamGroups, lr_scale, next_ramp

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)


class ProgressiveLinearLR(Callback):
    """Ramp the learning rate linearly to a new multiple of the scheduled LR after a batch-size change (Elan eq. 2–3).

    The strategy calls :meth:`start_ramp` on every rank at an adjustment (through
    :meth:`HybridScaling.apply <lightning_elan.callbacks.HybridScaling.apply>`). The ramp lives in this callback's
    state, which Lightning saves in checkpoints and lightning_elan replicates to joiners.

    Args:
        ramp_steps: optimizer steps from the adjustment to the target multiplier (T).
    """

    def __init__(self, ramp_steps: int = 100) -> None:
        if ramp_steps < 0:
            raise ValueError(f"ramp_steps must be >= 0, got {ramp_steps}")
        self.ramp_steps = ramp_steps
        self.ramp: LRRamp | None = None
        self._scaled: dict[int, ScaledParamGroups] = {}
        self._hooks: dict[int, RemovableHandle] = {}

    # ------------------------------------------------------------------ the ramp

    def scale_at(self, step: int) -> float:
        """The multiplier at optimizer step ``step``."""
        return lr_scale(step, self.ramp)

    @property
    def target_scale(self) -> float:
        return 1.0 if self.ramp is None else self.ramp.to_scale

    def start_ramp(self, step: int, to_scale: float) -> None:
        """From the multiplier in force at ``step`` (the next optimizer step), linearly to ``to_scale`` over
        ``ramp_steps`` steps. A ramp already heading to ``to_scale`` is left as it is."""
        if self.ramp is not None and self.ramp.to_scale == to_scale:
            return
        self.ramp = next_ramp(self.ramp, step, to_scale, self.ramp_steps)
        log.info("LR ramp from x%g at step %d to x%g at step %d", self.ramp.from_scale, step, to_scale,
                 self.ramp.end_step)

    # ------------------------------------------------------------------ hooks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            self._hook(optimizer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        scale = self.scale_at(trainer.global_step)
        pl_module.log("elan/lr_scale", scale, on_step=True, on_epoch=False)
        if scale == 1.0 or id(optimizer) in self._scaled or _grad_scaler_skips(trainer, optimizer):
            return  # nothing to do, already scaled (closure evaluated again, e.g. LBFGS), or no update this step
        self._hook(optimizer)
        self._scaled[id(optimizer)] = ScaledParamGroups(optimizer, scale)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._restore_all(trainer)  # a step that never ran its post-hooks

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_all(trainer)
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _hook(self, optimizer: Optimizer) -> None:
        if id(optimizer) not in self._hooks and hasattr(optimizer, "register_step_post_hook"):
            self._hooks[id(optimizer)] = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        scaled = self._scaled.pop(id(optimizer), None)
        if scaled is not None:
            scaled.restore(optimizer)

    def _restore_all(self, trainer: pl.Trainer) -> None:
        for optimizer in trainer.optimizers:
            self._after_step(optimizer, (), {})
        self._scaled.clear()

    # ------------------------------------------------------------------ state (checkpoints and replication)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"ramp": None if self.ramp is None else self.ramp.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ramp = state_dict.get("ramp")
        self.ramp = None if ramp is None else LRRamp.from_dict(ramp)


def _grad_scaler_skips(trainer: pl.Trainer, optimizer: Optimizer) -> bool:
    """True when AMP's GradScaler found inf/NaN gradients and will skip ``optimizer.step`` (its post-hooks would not
    run, and the scheduler would see a scaled LR). Lightning unscales before ``on_before_optimizer_step``, which
    records the check; ``_found_inf_per_device`` is torch's (private) accessor for it."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    found_inf = getattr(scaler, "_found_inf_per_device", None)
    if scaler is None or found_inf is None or not scaler.is_enabled():
        return False
    return bool(sum(value.item() for value in found_inf(optimizer).values()))
