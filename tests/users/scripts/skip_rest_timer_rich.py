"""Epochs cut short from a hook, a wall-clock budget, a rich progress bar and device statistics.

    python skip_rest_timer_rich.py OUT

``on_train_batch_start`` returns -1 to skip the rest of an epoch (Lightning's contract): epoch 0 stops before its
batch 6, epoch 2 before its batch 3 (epoch 1 runs whole). ``Trainer(max_time=...)`` adds Lightning's ``Timer``, which
broadcasts its stop decision from rank 0 after every batch; ``RichProgressBar`` and ``DeviceStatsMonitor(cpu_stats=
True)`` (psutil) as a user adds them; each epoch's largest squared error
is logged with ``reduce_fx="max"``. ``OUT/skipped.json``
(rank 0): the batches each epoch trained and the timer's elapsed-time record. Float64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor, RichProgressBar, Timer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

SKIP_FROM = {0: 6, 2: 3}
"""Epoch: the first batch index not trained (the hook returns -1 there)."""


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
        self.y = (self.x[:, :1] * self.x[:, 1:2]).sin() + self.x[:, 2:3]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class CutShort(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.GELU(), torch.nn.Linear(12, 1)).double()
        self.trained: dict[int, list[int]] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if batch_idx >= SKIP_FROM.get(self.current_epoch, 1 << 30):
            return -1
        self.trained.setdefault(self.current_epoch, []).append(batch_idx)
        return None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        errors = (self.net(x) - y).square()
        loss = errors.mean()
        self.log("train_loss", loss, sync_dist=True)
        self.log("worst_error", errors.max(), sync_dist=True, on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Points(96, 4), batch_size=6, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(11)
    model, timer = CutShort(), Timer(duration={"hours": 2}, interval="step")
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="cut"),
                         callbacks=[timer, RichProgressBar(), DeviceStatsMonitor(cpu_stats=True)])
    trainer.fit(model)
    if trainer.is_global_zero:
        result = {"trained": model.trained, "steps": trainer.global_step, "elapsed": timer.time_elapsed("train")}
        (out / "skipped.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
