"""An ordinary user's Lightning script: a model, a CSV logger, checkpoints, validation. It knows nothing of
lightning_elan's internals; only ``strategy="elan"``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        time.sleep(0.2)  # a slow model: the test has time to kill a worker mid-epoch
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(samples: int, seed: int, shuffle: bool) -> DataLoader:
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=shuffle)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=out,
        logger=CSVLogger(out / "logs", flush_logs_every_n_steps=1), log_every_n_steps=1,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=5, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Regression(), loader(96, 0, True), loader(24, 1, False))
