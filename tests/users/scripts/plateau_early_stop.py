"""Decay the learning rate every epoch, halve it when the validation loss stops falling, and stop when it no longer
improves.

    python plateau_early_stop.py OUT

Two schedulers on one optimizer: ``ExponentialLR`` with Lightning's default interval (once per epoch), and
``ReduceLROnPlateau`` monitoring ``val_loss`` (validated every epoch), which halves the learning rate after each epoch
that did not improve it; ``EarlyStopping`` ends the fit after two such epochs in a row, well before ``max_epochs``.
``ModelCheckpoint`` keeps the two best checkpoints by ``val_loss``, looked at every 3 training steps (so mostly
between validations: the last validation's loss) in ``OUT/checkpoints``.
``LearningRateMonitor`` logs the rate every epoch to ``OUT/logs/plateau/version_0/metrics.csv``; rank 0 writes
``OUT/stopped.json`` (the epoch EarlyStopping stopped at, the step and the final learning rate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

LR, MAX_EPOCHS = 0.3, 12


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

    def configure_optimizers(self) -> tuple[list[Any], list[Any]]:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)  # Lightning's default: once per epoch
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return [optimizer], [decay, {"scheduler": plateau, "monitor": "val_loss"}]



def main(out: Path) -> None:
    pl.seed_everything(23)
    stopping = EarlyStopping(monitor="val_loss", patience=2)
    best = ModelCheckpoint(out / "checkpoints", "{epoch}-{step}-{val_loss:.4f}", monitor="val_loss", save_top_k=2,
                           every_n_train_steps=3)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=MAX_EPOCHS, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="plateau"),
                         callbacks=[stopping, best, LearningRateMonitor("epoch")])
    trainer.fit(Model(), DataLoader(Points(96, 0), batch_size=6, shuffle=True),
                DataLoader(Points(24, 1), batch_size=4))
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stopped.json").write_text(json.dumps({
            "stopped_epoch": stopping.stopped_epoch, "step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
