"""A regression model trained from a LightningDataModule that "downloads" its data in ``prepare_data`` (it writes
CSV files into the data directory) and reads them in ``setup``; torchmetrics metrics and ``self.log(sync_dist=True)``,
``EarlyStopping``, ``LearningRateMonitor``, ``ModelCheckpoint(every_n_train_steps, save_top_k, save_last)`` and
gradient clipping.

    python datamodule_callbacks.py OUT [--prepare-per-node | --prepare-once]

Everything it produces is under OUT: the data, the CSV logs and the checkpoints.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

FEATURES = 6
SPLITS = {"train": 96, "val": 24}


class CsvDataset(Dataset):
    def __init__(self, rows: list[list[float]]) -> None:
        table = torch.tensor(rows, dtype=torch.float64)
        self.x, self.y = table[:, :FEATURES], table[:, FEATURES:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class RegressionData(pl.LightningDataModule):
    def __init__(self, data_dir: Path, prepare_per_node: bool, batch_size: int = 6) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.prepare_data_per_node = prepare_per_node
        self.batch_size = batch_size
        self.splits: dict[str, CsvDataset] = {}

    def prepare_data(self) -> None:
        """The "download": one CSV per split, written once (per node, or once for the job)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "prepared.log").open("a") as log:
            log.write(f"{os.getpid()}\n")
        generator = torch.Generator().manual_seed(2024)
        weights = torch.linspace(-1.0, 1.0, FEATURES, dtype=torch.float64)
        for split, size in SPLITS.items():
            x = torch.randn(size, FEATURES, generator=generator, dtype=torch.float64)
            y = torch.sin(x @ weights)[:, None] + 0.1 * x[:, :1]
            path = self.data_dir / f"{split}.csv"
            if path.exists():
                continue
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # renamed when whole
            with partial.open("w", newline="") as file:
                csv.writer(file).writerows([[repr(v) for v in row] for row in torch.cat([x, y], 1).tolist()])
            partial.replace(path)

    def setup(self, stage: str) -> None:
        for split in SPLITS:
            with (self.data_dir / f"{split}.csv").open(newline="") as file:
                self.splits[split] = CsvDataset([[float(v) for v in row] for row in csv.reader(file)])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=4)


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1)).double()
        self.train_mse = torchmetrics.MeanSquaredError()
        self.val_mse = torchmetrics.MeanSquaredError()
        self.val_r2 = torchmetrics.R2Score()
        for metric in (self.train_mse, self.val_mse, self.val_r2):
            metric.set_dtype(torch.float64)  # the model is float64: so are the metrics' sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        prediction = self(x)
        loss = torch.nn.functional.mse_loss(prediction, y)
        self.train_mse(prediction, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        prediction = self(x)
        self.val_mse(prediction, y)
        self.val_r2(prediction.squeeze(1), y.squeeze(1))
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.log_dict({"val_mse": self.val_mse, "val_r2": self.val_r2})

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    once = parser.add_mutually_exclusive_group()
    once.add_argument("--prepare-per-node", dest="per_node", action="store_true", default=True)
    once.add_argument("--prepare-once", dest="per_node", action="store_false")
    args = parser.parse_args()

    pl.seed_everything(11)
    data = RegressionData(args.out / "data", args.per_node)
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=6, default_root_dir=args.out,
        logger=CSVLogger(args.out / "logs", name="regression"), log_every_n_steps=1,
        gradient_clip_val=0.5,
        callbacks=[
            EarlyStopping(monitor="val_loss", min_delta=0.028, patience=1),
            LearningRateMonitor(logging_interval="step"),
            ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=4, save_top_k=2,
                            monitor="train_loss_step", save_last=True),
        ],
        enable_progress_bar=False, enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
