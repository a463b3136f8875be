"""Validation metrics as a torchmetrics ``MetricCollection`` computed and logged in ``on_validation_epoch_end``
(``log_dict(collection.compute(), sync_dist=True)``: torchmetrics syncs its states itself), a sanity check of two
batches, two ``CSVLogger``\\ s and ``LearningRateMonitor``, ``profiler="simple"``, ``deterministic=True``,
``max_steps`` with a fractional ``limit_train_batches`` and ``val_check_interval``, gradient clipping, the gradient
and weight norms logged from ``on_after_backward`` and ``on_before_optimizer_step``, ``ReduceLROnPlateau`` returned in
a dict with its ``monitor``, ``ModelCheckpoint(every_n_train_steps=4, save_top_k=2, monitor=…)``, loader workers kept
alive (``num_workers=2``, ``persistent_workers``) and the loaders reloaded every epoch.

    python metrics_loggers_profiler.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = (self.x[:, :1] * 2 - self.x[:, 1:2] * self.x[:, 2:3]).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        metrics = {"mse": torchmetrics.MeanSquaredError(), "mae": torchmetrics.MeanAbsoluteError()}
        self.val_metrics = torchmetrics.MetricCollection(metrics, prefix="val_")
        self.val_metrics.set_dtype(torch.float64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        norm = torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]).norm()
        self.log("grad_norm", norm, sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("weight_norm", torch.stack([p.norm() for p in self.parameters()]).norm(), sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        prediction = self.net(x)
        self.val_metrics.update(prediction, y)
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), sync_dist=True)
        self.val_metrics.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Points(144, 0), batch_size=6, shuffle=True, num_workers=2, persistent_workers=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Points(48, 1), batch_size=8, num_workers=2, persistent_workers=True)


def main(out: Path) -> None:
    pl.seed_everything(11)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_steps=30, limit_train_batches=0.75,
                         val_check_interval=0.5, num_sanity_val_steps=2, gradient_clip_val=0.5,
                         logger=[CSVLogger(out, name="csv_a"), CSVLogger(out, name="csv_b")], log_every_n_steps=1,
                         profiler="simple", deterministic=True, reload_dataloaders_every_n_epochs=1,
                         enable_progress_bar=False,
                         callbacks=[LearningRateMonitor("step"),
                                    ModelCheckpoint(out / "checkpoints", every_n_train_steps=4, save_top_k=2,
                                                    monitor="val_loss", save_last=True)])
    trainer.fit(Model())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
