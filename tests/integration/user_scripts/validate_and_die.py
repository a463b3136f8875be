"""An ordinary user's Lightning script that validates twice per epoch and may SIGKILL itself once: a model, a CSV
logger, a torchmetrics accuracy, a plateau scheduler, checkpoints named by the validation loss. It knows nothing of
lightning_elan's internals; only ``strategy="elan"``.

python validate_and_die.py OUT [--accumulate N] [--die-validating STEP:BATCH] [--die-training EPOCH:BATCH:RANK]

``--die-validating``: the process of rank 1 SIGKILLs itself in ``validation_step`` of the validation that runs at
global step STEP, at its batch BATCH. ``--die-training``: the process of rank RANK SIGKILLs itself in
``training_step`` at (EPOCH, BATCH). Each fires once per job (``OUT/died`` marks it). At the end rank 0 writes
``OUT/final.pt`` (the parameters) and ``OUT/final.json`` (the step counters and the scheduler's state).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 5, generator=generator, dtype=torch.float64)
    noise = torch.randn(samples, generator=generator, dtype=torch.float64)
    return TensorDataset(x, (x.sum(dim=1) + 2 * noise > 0).long())


class Classifier(pl.LightningModule):
    def __init__(self, out: Path, die_validating: tuple[int, ...] | None, die_training: tuple[int, ...] | None):
        super().__init__()
        self.net = nn.Linear(5, 2).double()
        self.val_accuracy = torchmetrics.Accuracy(task="binary")
        self.out, self.die_validating, self.die_training = out, die_validating, die_training

    def die_once(self) -> None:
        marker = self.out / "died"
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def training_step(self, batch, batch_idx):
        if self.die_training == (self.current_epoch, batch_idx, self.global_rank):
            self.die_once()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if (not self.trainer.sanity_checking and self.global_rank == 1
                and self.die_validating == (self.global_step, batch_idx)):
            self.die_once()
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_accuracy(logits.argmax(dim=-1), y)
        self.log("val_acc", self.val_accuracy)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.7, patience=0, threshold=0.0)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}}


def point(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(part) for part in text.split(":"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--die-validating")
    parser.add_argument("--die-training")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Classifier(args.out, point(args.die_validating), point(args.die_training))
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=2, val_check_interval=0.5, log_every_n_steps=1,
        accumulate_grad_batches=args.accumulate, logger=CSVLogger(args.out, name="logs", version=""),
        callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", monitor="val_loss", save_top_k=-1,
                                   filename="{epoch}-{step}-{val_loss:.9f}")],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True),
                DataLoader(dataset(40, 1), batch_size=5))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()},
                   args.out / "final.pt")
        plateau = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        (args.out / "final.json").write_text(json.dumps({
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "scheduler": {key: plateau[key] for key in ("last_epoch", "num_bad_epochs", "best", "_last_lr")},
        }))
