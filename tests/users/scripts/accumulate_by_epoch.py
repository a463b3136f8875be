"""Accumulate gradients over more batches as training goes on.

    python accumulate_by_epoch.py OUT

``GradientAccumulationScheduler({1: 2})``: every batch is an optimizer step in the first epoch, every second batch
from the second epoch on (Lightning's callback sets ``trainer.accumulate_grad_batches`` at each epoch's start); Adam
with a step ``StepLR``; the loss is logged every batch to ``OUT/logs/accumulate/version_0/metrics.csv``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 3, generator=generator, dtype=torch.float64) * 4 - 2
        self.y = (self.x[:, :1] * self.x[:, 1:2] - self.x[:, 2:]).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(out: Path) -> None:
    pl.seed_everything(29)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="accumulate"),
                         callbacks=[GradientAccumulationScheduler({1: 2})])
    trainer.fit(Model(), DataLoader(Points(96, 0), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
