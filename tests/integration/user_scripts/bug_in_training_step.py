"""An ordinary user's Lightning script with a bug in its ``training_step``: from the step given on its command line it
indexes its batch out of range (``python bug_in_training_step.py OUT STEP [RANK] [--bug index|dtype]``: on every
process, or on the process of that rank only, as a data-dependent bug does); ``--bug dtype`` feeds its float32 net a
float64 batch instead (torch's ``RuntimeError: mat1 and mat2 must have the same dtype``). It knows nothing of
lightning_elan but ``strategy="elan"``."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


class Regression(pl.LightningModule):
    def __init__(self, buggy_from: int, buggy_rank: int | None, bug: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.buggy_from, self.buggy_rank, self.bug = buggy_from, buggy_rank, bug

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step >= self.buggy_from and self.buggy_rank in (None, self.global_rank):
            if self.bug == "dtype":
                x = x.double()  # the bug: the net is float32
            else:
                y = batch[2]  # the bug: the batch is [x, y]
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("step", type=int)
    parser.add_argument("rank", type=int, nargs="?")
    parser.add_argument("--bug", choices=("index", "dtype"), default="index")
    args = parser.parse_args()
    pl.seed_everything(0)
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=args.out, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    trainer.fit(Regression(args.step, args.rank, args.bug), loader)
