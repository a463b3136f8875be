"""An exponential moving average of the weights (Lightning's ``EMAWeightAveraging``), validated and checkpointed.

    python ema_weights.py OUT

``EMAWeightAveraging(decay=0.8)`` keeps an ``AveragedModel`` of the network, updated after every optimizer step; the
validation runs on the average (the callback swaps it in and out), ``ModelCheckpoint`` saves the average as the
checkpoint's ``state_dict`` (the current weights as ``current_model_state``), and at the end of ``fit`` the model
holds the average. Rank 0 writes ``OUT/ema.json``: the validation of the averaged model after ``fit``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Waves(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = torch.sin(3 * self.x[:, :1]) + self.x[:, 1:2] * self.x[:, 2:3] - self.x[:, 3:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 24), torch.nn.Tanh(), torch.nn.LayerNorm(24),
                                       torch.nn.Linear(24, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def main(out: Path) -> None:
    pl.seed_everything(23)
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_progress_bar=False,
                         enable_model_summary=False, logger=CSVLogger(out / "logs", name="ema"),
                         val_check_interval=4, log_every_n_steps=1,
                         callbacks=[EMAWeightAveraging(decay=0.8), checkpoints])
    model = Regressor()
    trainer.fit(model, DataLoader(Waves(96, 0), batch_size=6, shuffle=True),
                DataLoader(Waves(24, 1), batch_size=6))
    validated = trainer.validate(model, DataLoader(Waves(24, 1), batch_size=6))
    if trainer.global_rank == 0:
        (out / "ema.json").write_text(json.dumps({"validate": validated}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
