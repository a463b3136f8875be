"""HybridScaling: learns the job's throughput model while it trains and decides the global batch at every resize."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_elan.callbacks.lr_ramp import ProgressiveLinearLR
from lightning_elan.scaling.batch import ScalingDecision
from lightning_elan.scaling.policy import ScalingPolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class HybridScaling(ScalingPolicy, Callback):
    """Strong, weak or Elan's hybrid scaling of the global batch when the job changes size.

    Every worker times its own steps (no synchronisation: see :mod:`lightning_elan.scaling.timing` for how a step is
    split into compute and all-reduce) and feeds a :class:`~lightning_elan.scaling.ThroughputModel`, kept in this
    callback's state so joiners and a new rank 0 inherit it. At an adjustment rank 0 calls :meth:`decide`; every rank
    then calls :meth:`apply` with the broadcast decision (which starts the LR ramp of any
    :class:`ProgressiveLinearLR`).

    Args:
        policy: ``"strong"`` (global batch kept), ``"weak"`` (×N'/N) or ``"hybrid"`` (Algorithm 1; strong until the
            throughput model is ready).
        min_local_batch: smallest per-worker batch Algorithm 1 may choose.
        max_local_batch: largest per-worker batch (memory cap; also shrinks the global batch on scale-in).
        max_global_batch: largest global batch.
        lr_rule: ``"linear"`` (LR × k) or ``"sqrt"`` (LR × √k) for a global batch multiplied by k.
        min_observations: steps per point before the model counts as ready.
        warmup_steps: steps not measured after the start and after every world-size change.
        backward_ratio: backward/forward compute ratio assumed until steps without communication measure it.
        learn: record measured steps (off: keep the model as loaded, e.g. from ``profile``).
        profile: path of a JSON ``ThroughputModel.state_dict()`` to start from (a measured or synthetic profile).
    """

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
        ScalingPolicy.__init__(self, policy, min_local_batch, max_local_batch, max_global_batch, lr_rule,
                               min_observations, warmup_steps, backward_ratio, learn, profile)
        self._trainer: pl.Trainer | None = None

    # ------------------------------------------------------------------ the integration points (see package doc)

    def apply(
        self, trainer: pl.Trainer, decision: ScalingDecision | Mapping[str, Any], step: int | None = None
    ) -> None:
        """On every rank, after the decision arrived: remember it and start the LR ramp at ``step`` (default: the
        trainer's ``global_step``, i.e. the first optimizer step taken with the new batch)."""
        if not isinstance(decision, ScalingDecision):
            decision = ScalingDecision.from_dict(dict(decision))
        self.record_decision(decision)
        start = trainer.global_step if step is None else step
        if decision.lr_scale is not None:
            for callback in _ramps(trainer.callbacks):
                callback.start_ramp(start, decision.lr_scale)

    def apply_resize(self, decision: ScalingDecision) -> None:
        """The elastic engine's ``ScalingParticipant.apply_resize``: the LR ramp starts at the next optimizer step of
        the trainer this callback was set up with."""
        assert self._trainer is not None, "HybridScaling.apply_resize before setup"
        self.apply(self._trainer, decision)

    # ------------------------------------------------------------------ hooks: timing on every worker

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        register = getattr(trainer.strategy, "register_scaling", None)
        if callable(register):  # the elan strategy: this callback decides the global batch at every resize
            register(self)
        if self.model.grad_bytes is None:
            self.model.grad_bytes = _gradient_bytes(pl_module)
        if self.policy != "strong" and not _ramps(trainer.callbacks):
            log.warning("HybridScaling(policy=%r) changes the global batch but no ProgressiveLinearLR scales the LR",
                        self.policy)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.track_world_size(trainer.world_size)
        local = _batch_length(batch)
        self._track_global_batch(trainer, local)
        if local is None and self.global_batch:
            local = math.ceil(self.global_batch / self.world_size)
        self.timer.batch_start(time.perf_counter(), local or 0, self.world_size)

    def _track_global_batch(self, trainer: pl.Trainer, local_batch: int | None) -> None:
        """The elan strategy's global batch; else the last decision's; else this batch × the world size."""
        guess = None if local_batch is None else local_batch * self.world_size
        self.track_global_batch(_strategy_global_batch(trainer) or self.global_batch or guess)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.timer.before_backward(time.perf_counter())

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.after_backward(time.perf_counter())

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.timer.optimizer_step()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        sample = self.timer.batch_end(time.perf_counter())
        if sample is None:
            return
        if getattr(trainer.strategy, "sample_weight", 1.0) != 0.0:  # not a stand-in sample of an empty share
            self.observe(sample.local_batch, sample.world_size, sample.compute_s, sample.allreduce_s)
        self._log(pl_module, sample.local_batch)

    def _log(self, pl_module: pl.LightningModule, local_batch: int) -> None:
        metrics = {"elan/local_batch": local_batch, "elan/world_size": self.world_size}
        if self.global_batch is not None:
            metrics["elan/global_batch"] = self.global_batch
        for name, value in metrics.items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ state (checkpoints and replication)

    @override
    def state_dict(self) -> dict[str, Any]:
        return ScalingPolicy.state_dict(self)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ScalingPolicy.load_state_dict(self, state_dict)


def _ramps(callbacks: Sequence[Callback]) -> list[ProgressiveLinearLR]:
    return [callback for callback in callbacks if isinstance(callback, ProgressiveLinearLR)]


def _gradient_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _strategy_global_batch(trainer: pl.Trainer) -> int | None:
    """The elan strategy's global batch (``data_position.global_batch``), when there is one."""
    position = getattr(trainer.strategy, "data_position", None)
    return getattr(position, "global_batch", None)


def _batch_length(batch: Any) -> int | None:
    """Samples in this worker's batch: the first dimension of the first tensor found."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            length = _batch_length(item)
            if length is not None:
                return length
    return None
