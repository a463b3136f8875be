"""A dataset that the global batch does not divide: the last batch of every epoch is short.

    python uneven_last_batch.py OUT [--drop-last]

101 training samples in batches of 6 per process (a global batch of 12 at the launch world of 2): each epoch ends in a
batch of 5 samples, or drops them with ``--drop-last`` (``DataLoader(drop_last=True)``); 29 validation samples in
batches of 4, their summed squared error and count logged. A sum-reduced loss divided by the batch size, as a user
writes a per-sample mean; SGD with Nesterov momentum and weight decay; 3 epochs. Float64.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Noisy(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 3, generator=generator, dtype=torch.float64)
        self.y = self.x.sum(dim=1, keepdim=True).cos() + 0.05 * torch.randn(size, 1, generator=generator,
                                                                               dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, drop_last: bool) -> None:
        super().__init__()
        self.drop_last = drop_last
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y, reduction="sum") / len(x)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_sse", torch.nn.functional.mse_loss(self.net(x), y, reduction="sum"), reduce_fx="sum",
                 sync_dist=True, batch_size=len(x))
        self.log("val_seen", float(len(x)), reduce_fx="sum", sync_dist=True, batch_size=len(x))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(101, 0), batch_size=6, shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(29, 1), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--drop-last", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(5)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(args.out / "logs", name="uneven"))
    trainer.fit(Model(args.drop_last))


if __name__ == "__main__":
    main()
