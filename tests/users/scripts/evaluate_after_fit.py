"""Train, then ``validate``, ``test`` and ``predict`` with the same Trainer: what a user runs at the end of a script.

    python evaluate_after_fit.py OUT

Rank 0 writes ``OUT/after_fit.json`` (the three results and the world they ran on); every process writes the
predictions it made, with their sample indices, to ``OUT/predictions/rank-<rank>.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
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
    def __init__(self) -> None:
        super().__init__()
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

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)
        self.log("test_max_error", (self(x) - y).abs().max(), sync_dist=True, reduce_fx="max")

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, x, _ = batch
        return index, self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class PredictionWriter(BasePredictionWriter):
    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="epoch")
        self.out = out

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        index = torch.cat([i for i, _ in predictions])
        values = torch.cat([p for _, p in predictions])
        torch.save({"index": index, "prediction": values}, self.out / f"rank-{trainer.global_rank}.pt")


def main(out: Path) -> None:
    pl.seed_everything(3)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PredictionWriter(out / "predictions")])
    model = Model()
    train = DataLoader(Points(96, 0), batch_size=6, shuffle=True)
    trainer.fit(model, train, DataLoader(Points(24, 1), batch_size=4))
    validated = trainer.validate(model, DataLoader(Points(24, 1), batch_size=4))
    tested = trainer.test(model, DataLoader(Points(36, 2), batch_size=5))
    trainer.predict(model, DataLoader(Points(36, 2), batch_size=5), return_predictions=False)
    if trainer.global_rank == 0:
        results = {"validate": validated, "test": tested, "world_size": trainer.world_size}
        (out / "after_fit.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
