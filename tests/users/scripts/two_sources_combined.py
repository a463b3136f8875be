"""Train on two data sources at once: ``train_dataloader`` returns a dict of loaders.

    python two_sources_combined.py OUT [--mode max_size_cycle|min_size|sequential]

Lightning wraps the dict in a ``CombinedLoader``: with its default ``max_size_cycle`` each batch is
``{"clean": ..., "noisy": ...}``, the shorter source (48 noisy samples, batch 3) cycled until the longer one (96
clean samples, batch 6) is exhausted; ``min_size`` stops with the shorter one. The loss weights the two sources; it is
logged every step to ``OUT/logs/combined/version_0/metrics.csv``. Float64.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Source(Dataset):
    def __init__(self, size: int, seed: int, noise: float) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 3, generator=generator, dtype=torch.float64) * 2 - 1
        clean = self.x @ torch.tensor([[0.5], [-1.0], [2.0]], dtype=torch.float64)
        self.y = clean + noise * torch.randn(size, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class TwoSources(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def train_dataloader(self) -> Any:
        loaders = {"clean": DataLoader(Source(96, 0, 0.0), batch_size=6, shuffle=True),
                   "noisy": DataLoader(Source(48, 1, 0.3), batch_size=3, shuffle=True)}
        return loaders if self.mode == "max_size_cycle" else CombinedLoader(loaders, mode=self.mode)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.mode == "sequential":
            batch, _, _ = batch
        losses = {name: torch.nn.functional.mse_loss(self.net(x), y) for name, (_, x, y) in batch.items()}
        loss = losses.get("clean", 0) + 0.5 * losses.get("noisy", 0)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", default="max_size_cycle")
    args = parser.parse_args()
    pl.seed_everything(17)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(args.out / "logs", name="combined"))
    trainer.fit(TwoSources(args.mode))


if __name__ == "__main__":
    main()
