"""An ordinary user's Lightning script that accumulates gradients and saves a checkpoint every few optimizer steps:
a float64 regression model, a CSV logger, ``ModelCheckpoint(every_n_train_steps=...)`` keeping every checkpoint. It
knows nothing of lightning_elan's internals; only ``strategy="elan"``.

python checkpoint_every_steps.py OUT [--accumulate N] [--every N] [--epochs N] [--accumulate-from-epoch E]

``--accumulate-from-epoch E``: accumulate ``--accumulate`` batches from epoch E on (``GradientAccumulationScheduler``),
one before it.

At the end rank 0 writes ``OUT/final.pt`` (the parameters) and ``OUT/final.json`` (the step counters).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 5, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate-from-epoch", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Regressor()
    callbacks = [ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=args.every, save_top_k=-1,
                                 filename="{epoch}-{step}")]
    if args.accumulate_from_epoch is not None:
        callbacks.append(GradientAccumulationScheduler({args.accumulate_from_epoch: args.accumulate}))
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=args.epochs, log_every_n_steps=1,
        accumulate_grad_batches=1 if args.accumulate_from_epoch is not None else args.accumulate,
        logger=CSVLogger(args.out, name="logs", version=""), callbacks=callbacks,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()},
                   args.out / "final.pt")
        (args.out / "final.json").write_text(json.dumps({"global_step": trainer.global_step,
                                                         "epoch": trainer.current_epoch}))
