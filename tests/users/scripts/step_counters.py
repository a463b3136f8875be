"""Counters a user keeps on the LightningModule and in a callback, as plain attributes, and lets steer the training:
``self.batches_seen`` (an int) weights the loss by a schedule of its own, ``self.weight_sum`` (a float) adds up the
weights, ``self.weight_trace`` (a tensor attribute, not a buffer) follows them in place, and a callback counts the
batches of each epoch in ``on_train_batch_end`` and the epochs in ``on_train_epoch_end``.
``accumulate_grad_batches=2``.

    python step_counters.py OUT

Rank 0 writes ``OUT/counters.json`` at the end of the fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = (self.x @ torch.linspace(-1, 1, 4, dtype=torch.float64)).unsqueeze(1).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1)).double()
        self.batches_seen = 0
        self.weight_sum = 0.0
        self.weight_trace = torch.zeros((), dtype=torch.float64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        self.batches_seen += 1
        weight = 1.0 + 0.25 * (self.batches_seen % 4)  # the user's own schedule, by the batches this process saw
        self.weight_sum += weight
        self.weight_trace.mul_(0.5).add_(weight)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return weight * loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class CountBatches(pl.Callback):
    def __init__(self) -> None:
        self.in_epoch = 0
        self.per_epoch: list[int] = []
        self.epochs = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.in_epoch += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_epoch.append(self.in_epoch)
        self.in_epoch = 0
        self.epochs += 1


def main(out: Path) -> None:
    pl.seed_everything(3)
    out.mkdir(parents=True, exist_ok=True)
    counter = CountBatches()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[counter])
    model = Model()
    trainer.fit(model, DataLoader(Points(96, 0), batch_size=6, shuffle=True))
    if trainer.global_rank == 0:
        (out / "counters.json").write_text(json.dumps({
            "batches_seen": model.batches_seen, "weight_sum": model.weight_sum,
            "weight_trace": float(model.weight_trace),
            "per_epoch": counter.per_epoch, "epochs": counter.epochs, "step": trainer.global_step}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
