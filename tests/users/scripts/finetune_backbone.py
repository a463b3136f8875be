"""Fine-tune a backbone the way Lightning's docs show: ``BackboneFinetuning`` keeps it frozen in the first epoch,
then unfreezes it and adds it to the optimizer as a second parameter group with its own learning rate.

    python finetune_backbone.py OUT

Adam over the parameters that require a gradient (the docs' ``filter(lambda p: p.requires_grad, ...)``), a CSV log
of the loss and of both groups' learning rates (``LearningRateMonitor``). Rank 0 writes ``OUT/groups.json`` (each
parameter group's learning rate and size at the end).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = (self.x[:, :2].sum(1, keepdim=True) * self.x[:, 2:3]).sin() + self.x[:, 3:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                            torch.nn.Tanh()).double()
        self.head = torch.nn.Linear(16, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.02)


def main(out: Path) -> None:
    pl.seed_everything(7)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5,
                                    backbone_initial_ratio_lr=0.1, initial_denom_lr=10.0)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, log_every_n_steps=1,
                         logger=CSVLogger(out, name="logs"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[finetuning, LearningRateMonitor(logging_interval="step")])
    model = Model()
    trainer.fit(model, DataLoader(Points(96, 0), batch_size=6, shuffle=True))
    if trainer.global_rank == 0:
        groups = [{"lr": group["lr"], "size": len(group["params"])} for group in trainer.optimizers[0].param_groups]
        (out / "groups.json").write_text(json.dumps(groups))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
