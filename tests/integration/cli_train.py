"""A LightningCLI script: `--trainer.strategy=elan` works once `lightning_elan` is imported."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


class RegressionModel(pl.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class RegressionData(pl.LightningDataModule):
    def __init__(self, samples: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def train_dataloader(self):
        x = torch.randn(self.samples, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=self.batch_size, shuffle=True)


if __name__ == "__main__":
    cli = LightningCLI(RegressionModel, RegressionData, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    strategy = cli.trainer.strategy
    print(f"strategy={type(strategy).__name__} coordinate_every={getattr(strategy, 'coordinate_every', None)} "
          f"steps={cli.trainer.global_step} world={cli.trainer.world_size}")
