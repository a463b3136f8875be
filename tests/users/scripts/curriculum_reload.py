"""A curriculum: every epoch trains on a larger, harder part of the data; a callback stops once the loss is low.

    python curriculum_reload.py OUT

``reload_dataloaders_every_n_epochs=1``: ``train_dataloader`` is called at every epoch's start and builds its loader
from ``self.current_epoch`` (epoch e trains on the 48 + 24·e easiest samples, reshuffled). ``StopWhenGoodEnough``
sets ``trainer.should_stop = True`` in ``on_train_epoch_end`` once the epoch's mean loss falls under a threshold.
``OUT/curriculum.json`` (rank 0) records each epoch's dataset size and the epoch training stopped at. Float64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, Subset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Graded(Dataset):
    """Samples sorted by difficulty (the norm of the input): index 0 is the easiest."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(size, 3, generator=generator, dtype=torch.float64)
        self.x = x[x.norm(dim=1).argsort()]
        self.y = torch.tanh(self.x[:, :1] - self.x[:, 1:2] * self.x[:, 2:])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class StopWhenGoodEnough(pl.Callback):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.stopped_at: int | None = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("train_loss_epoch")
        if loss is not None and loss.item() < self.threshold:
            trainer.should_stop = True
            self.stopped_at = trainer.current_epoch


class Curriculum(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.data = Graded(144, 0)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        self.sizes: dict[int, int] = {}

    def train_dataloader(self) -> DataLoader:
        size = min(48 + 24 * self.current_epoch, len(self.data))
        self.sizes[self.current_epoch] = size
        return DataLoader(Subset(self.data, range(size)), batch_size=6, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.03)


def main(out: Path) -> None:
    pl.seed_everything(37)
    model, stopper = Curriculum(), StopWhenGoodEnough(threshold=0.141)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=6, reload_dataloaders_every_n_epochs=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, logger=CSVLogger(out / "logs", name="curriculum"),
                         callbacks=[stopper])
    trainer.fit(model)
    if trainer.is_global_zero:
        result = {"sizes": model.sizes, "stopped_at": stopper.stopped_at, "steps": trainer.global_step}
        (out / "curriculum.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
