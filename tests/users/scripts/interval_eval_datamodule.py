"""A Lightning script the way the docs' pieces fit together: a ``LightningDataModule`` (``prepare_data`` writes the
data once, ``setup(stage)`` reads it per stage, ``teardown(stage)`` drops it), validation four times an epoch every
second epoch (``val_check_interval=0.25``, ``check_val_every_n_epoch=2``, ``limit_val_batches=3``), torchmetrics
metrics as module attributes, ``self.log_dict(..., sync_dist=True)``, ``on_train_epoch_end`` reading
``self.trainer.callback_metrics``, ``EarlyStopping`` + ``LearningRateMonitor`` + ``ModelCheckpoint(monitor=...,
save_top_k=2)``, then ``trainer.test(ckpt_path="best")`` and ``trainer.predict(ckpt_path="best")`` with a
``BasePredictionWriter`` writing every batch.

    python interval_eval_datamodule.py OUT [--limit-val-batches 3]

Outputs under OUT: ``data/`` (what ``prepare_data`` wrote), ``logs/`` (CSVLogger), ``checkpoints/``,
``predictions/batch-<rank>-<i>.pt`` (each predicted batch with its sample indices), ``teardown-<pid>.txt`` (the stages
each process tore down), and from rank 0 ``results.json`` (the test metrics, the best checkpoint, the world size).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanAbsoluteError, MeanSquaredError
from torchmetrics.regression import R2Score

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Indexed(TensorDataset):
    """``TensorDataset`` whose items start with their index."""

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return (index, *super().__getitem__(index))


class SurfaceData(pl.LightningDataModule):
    def __init__(self, data_dir: Path, batch_size: int = 6) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.train: Indexed | None = None
        self.val: Indexed | None = None
        self.test: Indexed | None = None

    def prepare_data(self) -> None:
        if (self.data_dir / "surface.pt").exists():
            return
        generator = torch.Generator().manual_seed(17)
        x = torch.rand(180, 4, generator=generator, dtype=torch.float64) * 2 - 1
        y = (x[:, :1] * 2).sin() + x[:, 1:2] * x[:, 2:3] - 0.5 * x[:, 3:]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        partial = self.data_dir / f"surface.pt.{os.getpid()}.tmp"  # under elan run a joiner may prepare meanwhile
        torch.save({"x": x, "y": y}, partial)
        os.replace(partial, self.data_dir / "surface.pt")

    def setup(self, stage: str) -> None:
        data = torch.load(self.data_dir / "surface.pt")
        x, y = data["x"], data["y"]
        if stage == "fit":
            self.train, self.val = Indexed(x[:96], y[:96]), Indexed(x[96:144], y[96:144])
        if stage in ("test", "predict"):
            self.test = Indexed(x[144:], y[144:])

    def teardown(self, stage: str) -> None:
        with open(self.data_dir.parent / f"teardown-{os.getpid()}.txt", "a") as record:
            record.write(stage + "\n")
        if stage == "fit":
            self.train = self.val = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=4)


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1)).double()
        self.train_mse = MeanSquaredError()
        self.val_mae = MeanAbsoluteError()
        self.test_r2 = R2Score()
        self.best_seen = float("inf")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        prediction = self(x)
        loss = torch.nn.functional.mse_loss(prediction, y)
        self.train_mse(prediction, y)
        self.log_dict({"train_loss": loss, "train_abs": (prediction - y).abs().mean()}, sync_dist=True,
                      on_step=True, on_epoch=True)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        prediction = self(x)
        self.val_mae(prediction, y)
        self.log_dict({"val_loss": torch.nn.functional.mse_loss(prediction, y)}, sync_dist=True)
        self.log("val_mae", self.val_mae)

    def on_train_epoch_end(self) -> None:
        seen = self.trainer.callback_metrics.get("val_loss")
        if seen is not None:
            self.best_seen = min(self.best_seen, float(seen))
            self.log("best_val_seen", self.best_seen, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        prediction = self(x)
        self.test_r2(prediction, y)
        self.log_dict({"test_loss": torch.nn.functional.mse_loss(prediction, y)}, sync_dist=True)
        self.log("test_r2", self.test_r2)

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, x, _ = batch
        return index, self(x)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class BatchWriter(BasePredictionWriter):
    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="batch")
        self.out = out

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        index, values = prediction
        torch.save({"index": index, "prediction": values},
                   self.out / f"batch-{trainer.global_rank}-{batch_idx}.pt")


def main(out: Path, limit_val_batches: float) -> None:
    pl.seed_everything(23)
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", mode="min", save_top_k=2,
                                 filename="{epoch}-{step}-{val_loss:.5f}")
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=6, val_check_interval=0.25, check_val_every_n_epoch=2,
        limit_val_batches=limit_val_batches, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(out, name="logs", version=0),
        callbacks=[EarlyStopping(monitor="val_loss", patience=6), LearningRateMonitor(logging_interval="step"),
                   checkpoint, BatchWriter(out / "predictions")],
    )
    data = SurfaceData(out / "data")
    model = Regressor()
    trainer.fit(model, datamodule=data)
    tested = trainer.test(model, datamodule=data, ckpt_path="best")
    trainer.predict(model, datamodule=data, ckpt_path="best", return_predictions=False)
    if trainer.global_rank == 0:
        best = Path(checkpoint.best_model_path).name if checkpoint.best_model_path else None
        results = {"test": tested, "best": best, "world_size": trainer.world_size,
                   "stopped_epoch": trainer.current_epoch}
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit-val-batches", type=float, default=3)
    args = parser.parse_args()
    main(args.out, int(args.limit_val_batches) if args.limit_val_batches > 1 else args.limit_val_batches)
