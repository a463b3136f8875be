"""A LightningModule whose network is ``torch.compile``d (float64, the default inductor backend).

    python compiled_regressor.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        net = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).double()
        self.net = torch.compile(net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)


def dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
    y = (x[:, :2].prod(dim=1, keepdim=True) + x[:, 2:].sum(dim=1, keepdim=True)).tanh()
    return TensorDataset(torch.arange(size), x, y)


def main(out: Path) -> None:
    pl.seed_everything(4)
    model = Regressor()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=out,
                         logger=CSVLogger(out / "logs", name="compiled"), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(96), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
