"""Full-batch-style fitting with L-BFGS: the optimizer evaluates the closure several times per step.

    python lbfgs_closure.py OUT

``torch.optim.LBFGS(max_iter=4, history_size=5)``: Lightning hands ``optimizer.step`` its closure (forward, backward)
and L-BFGS calls it up to 4 times per step (plus the first evaluation); the loss is logged every step to
``OUT/logs/lbfgs/version_0/metrics.csv``. Float64 throughout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Curve(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 2, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = torch.sin(3 * self.x[:, :1]) * self.x[:, 1:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Fitter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4, history_size=5)


def main(out: Path) -> None:
    pl.seed_everything(41)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="lbfgs"))
    trainer.fit(Fitter(), DataLoader(Curve(96, 3), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
