"""Sample by weight with the user's own sampler, and schedule the learning rate over the whole run.

    python weighted_onecycle.py OUT

The loader draws each epoch's order from a ``WeightedRandomSampler`` with its own generator (without replacement:
every sample once per epoch, hard ones first); ``OneCycleLR`` is sized with ``trainer.estimated_stepping_batches``
and stepped every batch; ``LearningRateMonitor`` logs it to ``OUT/logs/weighted/version_0/metrics.csv``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

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
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05,
                                                       total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(out: Path) -> None:
    pl.seed_everything(13)
    data = Points(96, 0)
    weights = (data.y.squeeze(1).abs() + 0.1).tolist()  # the larger targets more often first
    sampler = WeightedRandomSampler(weights, num_samples=len(data), replacement=False,
                                    generator=torch.Generator().manual_seed(17))
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="weighted"), callbacks=[LearningRateMonitor("step")])
    trainer.fit(Model(), DataLoader(data, batch_size=6, sampler=sampler))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
