"""A classifier driven by LightningCLI and a YAML config; its DataModule prepares the data once for the whole job
(``prepare_data_per_node = False``), the config limits training (``max_steps``, ``limit_train_batches``) and
validates every 3 batches of every second epoch (``val_check_interval``, ``check_val_every_n_epoch``).

    python cli_classifier.py fit --config cli_classifier.yaml --trainer.strategy=elan \\
        --trainer.default_root_dir OUT --trainer.logger.init_args.save_dir OUT --data.data_dir OUT/data
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

CLASSES = 3


class Blobs(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "features": self.x[index], "label": self.y[index]}


class BlobData(pl.LightningDataModule):
    def __init__(self, data_dir: str = "data", batch_size: int = 6, train_size: int = 96, val_size: int = 24) -> None:
        super().__init__()
        self.prepare_data_per_node = False  # one shared file system: the job downloads once
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.sizes = {"train": train_size, "val": val_size}
        self.sets: dict[str, Blobs] = {}

    def prepare_data(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "prepared.log").open("a") as log:
            log.write(f"{os.getpid()}\n")
        path = self.data_dir / "blobs.pt"
        if path.exists():
            return
        generator = torch.Generator().manual_seed(99)
        total = sum(self.sizes.values())
        labels = torch.randint(0, CLASSES, (total,), generator=generator)
        centres = torch.tensor([[2.0, 0.0, 0.0, 1.0], [-1.0, 2.0, 0.0, 0.0], [0.0, -1.0, 2.0, -1.0]],
                               dtype=torch.float64)
        features = centres[labels] + 1.2 * torch.randn(total, 4, generator=generator, dtype=torch.float64)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # renamed when whole
        torch.save({"features": features, "labels": labels}, partial)
        partial.replace(path)

    def setup(self, stage: str) -> None:
        data = torch.load(self.data_dir / "blobs.pt")
        train = self.sizes["train"]
        self.sets["train"] = Blobs(data["features"][:train], data["labels"][:train])
        self.sets["val"] = Blobs(data["features"][train:], data["labels"][train:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=self.batch_size)


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, CLASSES)).double()
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=CLASSES, average="macro")

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        logits = self.net(batch["features"])
        loss = torch.nn.functional.cross_entropy(logits, batch["label"])
        self.train_accuracy(logits, batch["label"])
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        logits = self.net(batch["features"])
        self.val_accuracy(logits, batch["label"])
        self.val_f1(logits, batch["label"])
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, batch["label"]), sync_dist=True)
        self.log_dict({"val_acc": self.val_accuracy, "val_f1": self.val_f1})

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


if __name__ == "__main__":
    LightningCLI(Classifier, BlobData)
