"""A regression model resumed with ``fit(ckpt_path="last")`` (``python resume_from_last_batch.py OUT EPOCHS``):
``ModelCheckpoint(every_n_train_steps=8, save_last=True)`` over epochs of 8 steps (96 samples, a global batch of 12 at
2 workers) saves on each epoch's last batch, so a second job with more epochs resumes from a checkpoint saved there
(Lightning's ``RESTARTED_ON_LAST``). Validation after every epoch. Each process appends the samples of its trained
batches to ``OUT/samples-<pid>.jsonl``; rank 0 writes ``OUT/final.pt`` and appends each validation's step to
``OUT/validations.jsonl``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


def points(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
    return TensorDataset(torch.arange(size), x, x.sum(1, keepdim=True).sin())


class Model(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = Path(out)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.2)  # a joiner scheduled in the second job lands while it trains
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with (self.out / f"samples-{os.getpid()}.jsonl").open("a") as record:
            record.write(json.dumps({"epoch": self.current_epoch, "samples": batch[0].tolist()}) + "\n")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            with (self.out / "validations.jsonl").open("a") as record:
                record.write(json.dumps({"step": self.global_step}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            torch.save({key: value.clone() for key, value in self.state_dict().items()}, self.out / "final.pt")


def main(out: Path, epochs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(3)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=epochs, enable_progress_bar=False,
                         enable_model_summary=False, logger=False, num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(out / "checkpoints", every_n_train_steps=8, save_last=True)])
    trainer.fit(Model(str(out)), DataLoader(points(96, 0), batch_size=6, shuffle=True),
                DataLoader(points(24, 1), batch_size=6), ckpt_path="last")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
