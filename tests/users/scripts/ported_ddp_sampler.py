"""A model ported from a plain PyTorch DDP script: it keeps its own ``DistributedSampler``.

    python ported_ddp_sampler.py OUT

``use_distributed_sampler=False`` and a ``DistributedSampler(shuffle=True, seed=5)`` built in ``train_dataloader``
(from the process group of the moment, as a DDP script builds it); the loss is logged every step to
``OUT/logs/ported/version_0/metrics.csv``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Pairs(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        self.y = self.x @ torch.tensor([[0.5], [-1.0], [2.0], [0.25]], dtype=torch.float64) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        data = Pairs(96, 0)
        return DataLoader(data, batch_size=6, sampler=DistributedSampler(data, shuffle=True, seed=5))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(out: Path) -> None:
    pl.seed_everything(3)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, use_distributed_sampler=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, logger=CSVLogger(out / "logs", name="ported"))
    trainer.fit(Model())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
