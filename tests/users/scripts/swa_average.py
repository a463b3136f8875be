"""Stochastic weight averaging over the last epochs, then a validation of the averaged model.

    python swa_average.py OUT

``StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)`` anneals the learning rate with its own ``SWALR`` and
averages the weights from the second epoch on; at the end the model holds the average. Rank 0 writes
``OUT/averaged.json`` (the validation loss of the averaged model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
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

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(out: Path) -> None:
    pl.seed_everything(19)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)])
    model = Model()
    trainer.fit(model, DataLoader(Points(96, 0), batch_size=6, shuffle=True))
    validated = trainer.validate(model, DataLoader(Points(24, 1), batch_size=4))
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "averaged.json").write_text(json.dumps({"validate": validated}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
