"""Gathering across processes the way the Lightning docs show it.

    python gather_outputs.py OUT

``training_step`` gathers the global batch's targets (``self.all_gather``; for a statistic over the whole batch) and
keeps its loss in a list; ``on_train_epoch_end`` stacks the list, clears it and gathers the stack (the Lightning 2.0
migration guide's replacement of ``training_epoch_end``), the steps trained summed by ``torch.distributed.all_reduce``
first. Rank 0 appends each epoch's gathered shape and mean to ``OUT/gathered.jsonl``.
With 4 samples per process and 2 processes the global batch is 8: 3 processes take 3, 3 and 2 of it.
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
        self.x = torch.rand(size, 3, generator=generator, dtype=torch.float64) * 4 - 2
        self.y = (self.x[:, :1] * self.x[:, 1:2] - self.x[:, 2:]).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).double()
        self.training_step_outputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        targets = self.all_gather(y)
        self.log("batch_target_mean", targets.mean(), rank_zero_only=True)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        losses = torch.stack(self.training_step_outputs)
        self.training_step_outputs.clear()  # free the memory, as the docs do
        steps = torch.tensor(float(len(losses)), dtype=torch.float64)
        torch.distributed.all_reduce(steps)  # the steps every process trained this epoch, summed (ported DDP code)
        gathered = self.all_gather(losses)
        if self.global_rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with (self.out / "gathered.jsonl").open("a") as file:
                file.write(json.dumps({"epoch": self.current_epoch, "shape": list(gathered.shape),
                                       "mean": gathered.mean().item(), "steps": steps.item()}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def main(out: Path) -> None:
    pl.seed_everything(23)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(out), DataLoader(Points(96, 0), batch_size=4, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
