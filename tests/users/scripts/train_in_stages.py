"""Fine-tune in two stages, each with its own ``Trainer``: first the head with the backbone frozen, then everything.

    python train_in_stages.py OUT

Each stage logs to ``OUT/logs/<stage>/version_0/metrics.csv`` (CSVLogger); rank 0 writes ``OUT/stages.json`` (the
global step each stage ended at and the validation loss after it) at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
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
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU()).double()
        self.head = torch.nn.Linear(16, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [parameter for parameter in self.parameters() if parameter.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr)


def stage(out: Path, name: str, model: Model, epochs: int) -> dict[str, Any]:
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=epochs, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name=name))
    trainer.fit(model, DataLoader(Points(96, 0), batch_size=6, shuffle=True))
    validated = trainer.validate(model, DataLoader(Points(24, 1), batch_size=4))
    return {"rank": trainer.global_rank, "step": trainer.global_step, "validate": validated}


def main(out: Path) -> None:
    pl.seed_everything(11)
    model = Model(lr=0.05)
    model.backbone.requires_grad_(False)
    head = stage(out, "head", model, epochs=2)
    model.backbone.requires_grad_(True)
    model.lr = 0.01
    everything = stage(out, "everything", model, epochs=2)
    if everything["rank"] == 0:
        (out / "stages.json").write_text(json.dumps({"head": head, "everything": everything}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
