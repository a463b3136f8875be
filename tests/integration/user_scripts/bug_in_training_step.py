"""An ordinary user's Lightning script with a bug in its ``training_step``: from the step given on its command line it
indexes its batch out of range (``python bug_in_training_step.py OUT STEP [RANK]``: on every process, or on
the process of that rank only, as a data-dependent bug does). It knows nothing of lightning_elan but
``strategy="elan"``."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


class Regression(pl.LightningModule):
    def __init__(self, buggy_from: int, buggy_rank: int | None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.buggy_from, self.buggy_rank = buggy_from, buggy_rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step >= self.buggy_from and self.buggy_rank in (None, self.global_rank):
            y = batch[2]  # the bug: the batch is [x, y]
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    out, step = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else None
    pl.seed_everything(0)
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=out, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(step, rank), DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4))
