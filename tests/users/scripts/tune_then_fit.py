"""Validate the untrained model, find a learning rate with Lightning's tuner, then train: how many scripts start.

    python tune_then_fit.py OUT

Every process writes what its script saw before ``fit`` to ``OUT/starts/<pid>.json`` (the baseline validation, the
LR finder's suggestion and the learning rate the model then trains with); rank 0 writes ``OUT/before_fit.json``
with the same, and ``OUT/after_fit.json`` (the validation after training) at the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.tuner import Tuner
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
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(out: Path) -> None:
    pl.seed_everything(5)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    train = DataLoader(Points(96, 0), batch_size=6, shuffle=True)
    validation = DataLoader(Points(24, 1), batch_size=4)
    baseline = trainer.validate(model, validation)
    finder = Tuner(trainer).lr_find(model, train_dataloaders=train, val_dataloaders=validation, min_lr=1e-3,
                                    max_lr=1.0, num_training=24)
    start = {"baseline": baseline, "suggestion": finder.suggestion(), "lr": model.lr,
             "losses": finder.results["loss"]}
    (out / "starts").mkdir(parents=True, exist_ok=True)
    (out / "starts" / f"{os.getpid()}.json").write_text(json.dumps(start))
    if trainer.global_rank == 0:
        (out / "before_fit.json").write_text(json.dumps(start))
    trainer.fit(model, train, validation)
    validated = trainer.validate(model, validation)
    if trainer.global_rank == 0:
        (out / "after_fit.json").write_text(json.dumps({"validate": validated}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
