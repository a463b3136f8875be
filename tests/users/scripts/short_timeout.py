"""A regression trained with a short collective timeout, as a user sets one to learn of a hung peer quickly.

    python short_timeout.py OUT [TIMEOUT_S]

``ElanStrategy(timeout=timedelta(seconds=TIMEOUT_S))`` (default 10), as ``DDPStrategy(timeout=...)``; a residual
MLP, AdamW with a cosine schedule stepped every batch, the loss logged every step to a CSV logger, 4 epochs.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_elan import ElanStrategy


class Ridges(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 6, generator=generator, dtype=torch.float64)
        self.y = (self.x[:, :3].sum(1, keepdim=True).relu() - self.x[:, 3:].prod(1, keepdim=True)).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 6)).double()
        self.head = torch.nn.Linear(6, 1).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(x + self.inner(x)), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=5e-3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(out: Path, timeout_s: float) -> None:
    pl.seed_everything(41)
    trainer = pl.Trainer(strategy=ElanStrategy(timeout=timedelta(seconds=timeout_s)), accelerator="cpu",
                         max_epochs=4, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, log_every_n_steps=1, logger=CSVLogger(out / "logs", name="ridges"))
    trainer.fit(Regressor(), DataLoader(Ridges(96, 0), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
