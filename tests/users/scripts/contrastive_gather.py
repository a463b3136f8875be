"""A two-tower contrastive model (CLIP's loss) whose negatives come from every process, as SimCLR/CLIP recipes do.

    python contrastive_gather.py OUT

Each process embeds its share of the batch with two encoders, gathers the other tower's embeddings from every
process with ``self.all_gather(..., sync_grads=True)`` (the gradients flow back through the gather: a collective in
the backward) and scores its own rows against the whole global batch; a row's positive sits at
``self.global_rank * n + i`` of the gathered tensor. ``on_train_epoch_end`` writes rank 0's epoch loss (a
``sync_dist`` mean) to ``OUT/epochs.jsonl``. 6 samples per process: the global batch is 12 at 2 workers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Pairs(Dataset):
    """Two views of one hidden point: a sample's ``a`` and ``b`` belong together."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        self.a = hidden @ torch.randn(4, 6, generator=generator, dtype=torch.float64)
        self.b = (hidden @ torch.randn(4, 5, generator=generator, dtype=torch.float64)).tanh()

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.a[index], self.b[index]


class TwoTowers(pl.LightningModule):
    def __init__(self, out: Path, temperature: float = 0.5) -> None:
        super().__init__()
        self.out = out
        self.temperature = temperature
        self.tower_a = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()
        self.tower_b = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, a, b = batch
        za = F.normalize(self.tower_a(a), dim=1)
        zb = F.normalize(self.tower_b(b), dim=1)
        all_za = self.all_gather(za, sync_grads=True).reshape(-1, za.shape[1])
        all_zb = self.all_gather(zb, sync_grads=True).reshape(-1, zb.shape[1])
        labels = torch.arange(len(a), device=a.device) + self.global_rank * len(a)
        loss = (F.cross_entropy(za @ all_zb.T / self.temperature, labels)
                + F.cross_entropy(zb @ all_za.T / self.temperature, labels)) / 2
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        epoch_loss = self.trainer.callback_metrics["train_loss_epoch"].item()
        if self.global_rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with (self.out / "epochs.jsonl").open("a") as file:
                file.write(json.dumps({"epoch": self.current_epoch, "loss": epoch_loss}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def main(out: Path) -> None:
    pl.seed_everything(31)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TwoTowers(out), DataLoader(Pairs(96, 3), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
