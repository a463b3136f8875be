"""One dataset split into training and validation samples by index, the way many PyTorch tutorials do it.

    python subset_split_samplers.py OUT

A seeded permutation of the 120 samples: the first 96 train, the other 24 validate. Both loaders read the same
``Dataset`` through a ``SubsetRandomSampler`` of their indices (no generator of their own: the global one, as the
tutorials write it). Validation logs the loss, the number of samples it saw and how many of them were not validation
samples (``val_foreign``, summed over the processes). Float64; ``OUT/logs/subset/version_0``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Readings(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
        self.y = (self.x[:, :2].prod(1, keepdim=True) + self.x[:, 2:].sum(1, keepdim=True)).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, val_indices: list[int]) -> None:
        super().__init__()
        self.register_buffer("val_indices", torch.tensor(val_indices))
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 24), torch.nn.ReLU(), torch.nn.Linear(24, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        index, x, y = batch
        errors = ((self.net(x) - y) ** 2).sum()
        foreign = (~torch.isin(index, self.val_indices)).sum().double()
        count = torch.tensor(float(len(index)), dtype=torch.float64)
        self.log("val_sse", errors, reduce_fx="sum", sync_dist=True, batch_size=len(index))
        self.log("val_seen", count, reduce_fx="sum", sync_dist=True, batch_size=len(index))
        self.log("val_foreign", foreign, reduce_fx="sum", sync_dist=True, batch_size=len(index))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(out: Path) -> None:
    pl.seed_everything(47)
    data = Readings(120, 0)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1)).tolist()
    train_indices, val_indices = order[:96], order[96:]
    train = DataLoader(data, batch_size=6, sampler=SubsetRandomSampler(train_indices))
    val = DataLoader(data, batch_size=6, sampler=SubsetRandomSampler(val_indices))
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         num_sanity_val_steps=0, logger=CSVLogger(out / "logs", name="subset"))
    trainer.fit(Model(val_indices), train, val)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
