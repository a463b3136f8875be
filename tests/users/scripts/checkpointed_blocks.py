"""A deep residual network trained with activation checkpointing and tied input/output weights.

    python checkpointed_blocks.py OUT [--reentrant]

Each residual block runs under ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``, as PyTorch
recommends; ``--reentrant`` for the older form many scripts still use): its activations are recomputed in the
backward. The input projection's weight is the output layer's, transposed (weight tying, as language models do). AdamW
with a linear warm-up (``LambdaLR``, stepped every batch); the loss logged every step to a CSV logger, and the last
checkpoint kept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Spirals(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.stack([self.x[:, :4].sum(1).sin(), (self.x[:, 4:] ** 2).mean(1)], 1).repeat(1, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Deep(pl.LightningModule):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.project = torch.nn.Linear(8, 32, bias=False)
        self.blocks = torch.nn.ModuleList(Block(32) for _ in range(4))
        self.head_bias = torch.nn.Parameter(torch.zeros(8))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return h @ self.project.weight + self.head_bias  # the output layer is the input projection, tied

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        if self.reentrant:
            x = x.requires_grad_()  # the reentrant form needs an input that requires grad
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main(out: Path, reentrant: bool) -> None:
    pl.seed_everything(31)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="deep"),
                         callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)])
    trainer.fit(Deep(reentrant), DataLoader(Spirals(96, 0), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--reentrant" in sys.argv[2:])
