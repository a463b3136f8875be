"""A torchvision-style CNN (convolutions, BatchNorm, a residual block, global pooling) on small synthetic images,
with a random horizontal flip as augmentation, loader worker processes, and ``precision="bf16-mixed"`` on the CPU.

    python cnn_batchnorm_bf16.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

CLASSES = 3


class Patterns(Dataset):
    """8×8 one-channel images of three classes: horizontal stripes, vertical stripes, a checkerboard (plus noise)."""

    def __init__(self, size: int, seed: int, augment: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        rows = torch.arange(8).view(8, 1).expand(8, 8)
        cols = rows.t()
        patterns = torch.stack([rows % 2, cols % 2, (rows + cols) % 2]).float()
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        noise = 0.4 * torch.randn(size, 1, 8, 8, generator=generator)
        self.images = patterns[self.labels].unsqueeze(1) + noise
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment and torch.rand(()) < 0.5:  # RandomHorizontalFlip
            image = image.flip(-1)
        return index, image, self.labels[index]


def conv_bn(inputs: int, outputs: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_bn(1, 8), BasicBlock(8), conv_bn(8, 12, stride=2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ImageClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = SmallResNet()
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, images, labels = batch
        loss = nn.functional.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, images, labels = batch
        logits = self.model(images)
        self.val_accuracy(logits, labels)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", self.val_accuracy)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)}


def main(out: Path) -> None:
    pl.seed_everything(1)
    loader_args = {"num_workers": 2, "persistent_workers": True}
    train = DataLoader(Patterns(96, 0, augment=True), batch_size=6, shuffle=True, **loader_args)
    val = DataLoader(Patterns(24, 1, augment=False), batch_size=6, **loader_args)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", precision="bf16-mixed", max_epochs=2,
                         default_root_dir=out, logger=CSVLogger(out / "logs", name="cnn"), log_every_n_steps=1,
                         callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=5,
                                                    save_top_k=-1, save_last=True)],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ImageClassifier(), train, val)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
