"""Prune a fifth of the weights after every epoch with Lightning's ``ModelPruning`` (L1, unstructured), keep a
checkpoint of every epoch, and report how sparse the network ended.

    python prune_weights.py OUT

Rank 0 writes ``OUT/sparsity.json``: each pruned layer's count of zero weights at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def main(out: Path) -> None:
    pl.seed_everything(5)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, log_every_n_steps=1,
                         logger=CSVLogger(out, name="logs"), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelPruning("l1_unstructured", amount=0.2),
                                    ModelCheckpoint(out / "checkpoints", "{epoch}-{step}", save_top_k=-1)])
    model = Model()
    trainer.fit(model, DataLoader(Points(96, 0), batch_size=6, shuffle=True))
    if trainer.global_rank == 0:
        zeros = {name: int((module.weight == 0).sum()) for name, module in model.net.named_children()
                 if isinstance(module, torch.nn.Linear)}
        (out / "sparsity.json").write_text(json.dumps(zeros))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
