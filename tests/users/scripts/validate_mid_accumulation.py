"""Gradient accumulation with validation every few batches, so validation often runs in the middle of an
accumulation window: ``accumulate_grad_batches=3``, ``val_check_interval=5`` (batches, across epochs:
``check_val_every_n_epoch=None``), ``limit_val_batches=0.5``, ``gradient_clip_val``; ``self.all_gather`` of the
validation errors in ``on_validation_epoch_end``; training stopped mid-epoch by ``trainer.should_stop`` from
``on_train_batch_end``; ``ModelCheckpoint(monitor="val_loss", save_top_k=2)``; ``predict`` after ``fit``.

    python validate_mid_accumulation.py OUT

Rank 0 writes ``OUT/validations.jsonl`` (one line per validation: the step and the gathered sum of errors) and
``OUT/predicted.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

STOP_AT_STEP = 14


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 5, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = (self.x @ torch.linspace(-1, 1, 5, dtype=torch.float64)).unsqueeze(1).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.GELU(), torch.nn.Linear(12, 1)).double()
        self.errors: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step >= STOP_AT_STEP:
            self.trainer.should_stop = True

    def on_validation_epoch_start(self) -> None:
        self.errors.clear()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        error = (self(x) - y).pow(2).mean()
        self.errors.append(error.detach())
        self.log("val_loss", error, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        local = torch.stack(self.errors).sum() if self.errors else torch.zeros((), dtype=torch.float64)
        total = self.all_gather(local)
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            with (self.out / "validations.jsonl").open("a") as file:
                file.write(json.dumps({"step": self.global_step, "sum": float(total.sum())}) + "\n")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5, weight_decay=1e-3)


def main(out: Path) -> None:
    pl.seed_everything(9)
    out.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=50, accumulate_grad_batches=3,
                         gradient_clip_val=0.3, val_check_interval=5, check_val_every_n_epoch=None,
                         limit_val_batches=0.5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(out / "checkpoints", monitor="val_loss", save_top_k=2)])
    model = Model(out)
    trainer.fit(model, DataLoader(Points(120, 0), batch_size=6, shuffle=True),
                DataLoader(Points(48, 1), batch_size=6))
    predictions = trainer.predict(model, DataLoader(Points(24, 2), batch_size=6))
    if trainer.global_rank == 0:
        (out / "predicted.json").write_text(json.dumps({"rows": sum(len(p) for p in predictions),
                                                        "step": trainer.global_step}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
