"""A regression model trained from a LightningDataModule whose ``setup(stage)`` splits one dataset with a seeded
``random_split``, started with ``fit(ckpt_path="last")`` (a fresh directory: Lightning warns and starts from scratch;
a worker that joins later finds the members' ``last.ckpt``).

    python split_barriers_resume.py OUT

What a user writes around the training: the learning rate scaled by ``self.trainer.world_size`` in
``configure_optimizers`` (the linear scaling rule); in ``on_train_epoch_end`` rank 0 appends a row to
``OUT/summary.jsonl``, then every rank meets ``trainer.strategy.barrier()`` and ``torch.distributed.barrier()`` and
checks the file is there; custom state through ``on_save_checkpoint``/``on_load_checkpoint``; gradient clipping by
value; ``ModelCheckpoint(every_n_train_steps=5, save_top_k=2, monitor="train_loss", save_last=True)``;
``LearningRateMonitor``, ``ModelSummary(max_depth=2)`` and a ``TQDMProgressBar``. Rank 0 writes ``OUT/final.json``
(the epochs its ``on_train_epoch_end`` saw, carried through checkpoints and joins) in ``on_train_end``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelSummary, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, random_split

import lightning_elan  # noqa: F401  (registers strategy="elan")

BASE_LR, EPOCHS = 0.05, 2


class Table(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
        weights = torch.randn(5, 1, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x @ weights) + 0.1 * torch.randn(size, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "x": self.x[index], "y": self.y[index]}


class TableData(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = random_split(Table(120), [96, 24], generator=torch.Generator().manual_seed(42))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=6, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=6)


class Regressor(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
        self.epochs_summarised: list[int] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.epochs_summarised.append(self.current_epoch)
        summary = Path(self.hparams.out) / "summary.jsonl"
        if self.global_rank == 0:
            with summary.open("a") as file:
                file.write(json.dumps({"epoch": self.current_epoch, "step": self.global_step}) + "\n")
        self.trainer.strategy.barrier("summary written")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        assert summary.exists(), "rank 0 wrote it before the barrier"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["epochs_summarised"] = list(self.epochs_summarised)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.epochs_summarised = list(checkpoint["epochs_summarised"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=BASE_LR * self.trainer.world_size, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            final = {"epochs_summarised": self.epochs_summarised}
            (Path(self.hparams.out) / "final.json").write_text(json.dumps(final))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1234)
    checkpoints = ModelCheckpoint(out / "checkpoints", "{epoch}-{step}-{train_loss:.4f}", every_n_train_steps=5,
                                  save_top_k=2, monitor="train_loss", save_last=True)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=EPOCHS, gradient_clip_val=0.05,
                         gradient_clip_algorithm="value", log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="split"),
                         callbacks=[checkpoints, LearningRateMonitor("epoch"), ModelSummary(max_depth=2),
                                    TQDMProgressBar(refresh_rate=4)])
    trainer.fit(Regressor(str(out)), datamodule=TableData(), ckpt_path="last")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
