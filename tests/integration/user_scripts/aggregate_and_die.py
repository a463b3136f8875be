"""An ordinary user's Lightning script whose epoch values are reduced over the processes at the epoch's end, and
that may SIGKILL itself once: float64, ``self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)``
and a torchmetrics ``MeanSquaredError`` updated in ``training_step`` and logged per epoch, a ``CSVLogger``. It knows
nothing of lightning_elan's internals; only ``strategy="elan"``.

python aggregate_and_die.py OUT [--die RANK:STEP:PHASE]

``--die``: the process of rank RANK SIGKILLs itself in the training batch that starts at global step STEP, at PHASE:
``start`` (the LightningModule's ``on_train_batch_start``: the step is not committed yet, it is redone) or ``end``
(the LightningModule's ``on_train_batch_end``: the step stood, its part of the epoch's values is in the dead
process only). It fires once per job (``OUT/died`` marks it). At the end rank 0 writes ``OUT/final.pt`` (the
parameters).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=generator,
                                                                          dtype=torch.float64))


class Regression(pl.LightningModule):
    def __init__(self, out: Path, die: tuple[int, int, str] | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.train_mse = torchmetrics.MeanSquaredError().set_dtype(torch.float64)  # its sums as the model's
        self.out, self.die = out, die
        self.batch_step = -1

    def die_if_due(self, phase: str) -> None:
        marker = self.out / "died"
        if self.die == (self.global_rank, self.batch_step, phase) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_step = self.trainer.global_step
        self.die_if_due("start")

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x)
        loss = nn.functional.mse_loss(prediction, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.train_mse(prediction.detach(), y)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.die_if_due("end")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def point(text: str | None) -> tuple[int, int, str] | None:
    if text is None:
        return None
    rank, step, phase = text.split(":")
    return int(rank), int(step), phase


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Regression(args.out, point(args.die))
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(args.out, name="logs", version=""),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(dataset(48), batch_size=4, shuffle=True))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()},
                   args.out / "final.pt")
