"""ProgressiveLinearLR in a real single-process ``Trainer.fit``: composes with StepLR and OneCycleLR, checkpoints hold
unscaled LRs and the ramp, and a resumed run continues the ramp.

The LR the optimizer actually used is read back from the update itself: plain SGD in float64 moves a weight by
``lr · grad``, so ``(w_before − w_after) / grad`` is the LR of that step.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR
from lightning_elan.scaling import LRRamp, lr_scale

pytestmark = pytest.mark.integration

LR, STEPS, BATCH = 0.1, 12, 2
RAMP_AT, RAMP_STEPS = 4, 4  # the ramp runs over steps 4..8 (×1 → ×2); the checkpoint at step 6 is mid-ramp
EXPECTED_RAMP = LRRamp(RAMP_AT, RAMP_STEPS, 1.0, 2.0)


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2 * LR, total_steps=STEPS, cycle_momentum=False)


def scheduler_lrs(kind: str) -> list[float]:
    """The unscaled LR of every step, from the same scheduler driven by hand."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = make_scheduler(kind, optimizer)
    lrs = []
    for step in range(STEPS + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        if step < STEPS:
            optimizer.step()
            scheduler.step()
    return lrs


class TinyRegression(pl.LightningModule):
    def __init__(self, scheduler: str) -> None:
        super().__init__()
        self.scheduler_kind = scheduler
        self.layer = nn.Linear(4, 1, bias=False, dtype=torch.float64)
        self.before: dict[int, tuple[float, torch.Tensor, torch.Tensor]] = {}
        self.used_lr: dict[int, float] = {}
        self.lr_after_step: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        scheduler = make_scheduler(self.scheduler_kind, optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):  # module hooks run after the callbacks' (the ramp applied)
        weight = self.layer.weight
        self.before[self.trainer.global_step] = (optimizer.param_groups[0]["lr"], weight.detach().clone(),
                                                 weight.grad.detach().clone())

    def on_train_batch_end(self, outputs, batch, batch_idx):  # after the optimizer and scheduler steps
        step = self.trainer.global_step - 1
        _, weight, grad = self.before[step]
        moved = weight - self.layer.weight.detach()
        self.used_lr[step] = (moved[grad != 0] / grad[grad != 0]).mean().item()
        self.lr_after_step[step] = self.trainer.optimizers[0].param_groups[0]["lr"]


class AdjustAt(Callback):
    """Plays the strategy: at step RAMP_AT, rank 0 decides (1 → 2 workers, weak scaling) and every rank applies."""

    def __init__(self, scaling: HybridScaling) -> None:
        self.scaling = scaling

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == RAMP_AT:
            self.scaling.apply(trainer, self.scaling.decide(n_old=1, n_new=2, global_batch=BATCH))


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def fit(
    scheduler: str, root, callbacks: list[Callback], ckpt_path: str | None = None
) -> tuple[TinyRegression, pl.Trainer]:
    model = TinyRegression(scheduler)
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", strategy="auto", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("scheduler", ["step", "onecycle"])
def test_used_lr_is_scheduler_lr_times_ramp_and_checkpoints_resume_the_ramp(scheduler, tmp_path):
    unscaled = scheduler_lrs(scheduler)
    expected = [unscaled[step] * lr_scale(step, EXPECTED_RAMP) for step in range(STEPS)]
    assert expected[RAMP_AT + 2] == pytest.approx(unscaled[RAMP_AT + 2] * 1.5)  # mid-ramp: really scaled

    scaling, ramp = HybridScaling(policy="weak"), ProgressiveLinearLR(ramp_steps=RAMP_STEPS)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    model, trainer = fit(scheduler, tmp_path, [scaling, ramp, AdjustAt(scaling), checkpoint])

    assert ramp.ramp == EXPECTED_RAMP
    steps = range(STEPS)
    assert [model.used_lr[s] for s in steps] == pytest.approx(expected, rel=1e-9)  # what the update used
    assert [model.before[s][0] for s in steps] == pytest.approx(expected, rel=1e-12)  # what the hook saw
    assert [model.lr_after_step[s] for s in steps] == pytest.approx(unscaled[1 : STEPS + 1], rel=1e-12)
    assert trainer.callback_metrics["elan/lr_scale"].item() == 2.0
    assert trainer.callback_metrics["elan/global_batch"].item() == 2 * BATCH  # the decided weak-scaled batch
    assert (trainer.callback_metrics["elan/world_size"].item(), trainer.callback_metrics["elan/local_batch"].item()) \
        == (1, BATCH)
    assert scaling.model.observation_counts()["compute"][str(BATCH)] > 0

    path = tmp_path / "ckpt" / "epoch=1-step=6.ckpt"  # mid-ramp, mid-epoch
    saved = torch.load(path, weights_only=False)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(unscaled[6], rel=1e-12)
    assert saved["callbacks"]["ProgressiveLinearLR"]["ramp"] == EXPECTED_RAMP.to_dict()
    assert saved["callbacks"]["HybridScaling"]["last_decision"]["lr_scale"] == 2.0

    resumed_scaling, resumed_ramp = HybridScaling(policy="weak"), ProgressiveLinearLR(ramp_steps=RAMP_STEPS)
    resumed, _ = fit(scheduler, tmp_path / "resumed", [resumed_scaling, resumed_ramp], ckpt_path=str(path))
    assert resumed_ramp.ramp == EXPECTED_RAMP
    assert resumed_scaling.last_decision == scaling.last_decision
    assert sorted(resumed.used_lr) == list(range(6, STEPS))
    assert [resumed.used_lr[s] for s in range(6, STEPS)] == pytest.approx(expected[6:], rel=1e-9)
