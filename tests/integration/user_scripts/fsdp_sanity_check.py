"""An ordinary Lightning script under ``strategy="elan_fsdp"`` with Lightning's default sanity check
(``python fsdp_sanity_check.py OUT [--die-in-sanity-check WORKER] [--units]``).

A float64 MLP trained with Adam, a validation loop each epoch (``self.log(..., sync_dist=True)``) and the default
``num_sanity_val_steps=2``. Every process appends the samples of each trained batch to ``OUT/trained-<pid>.jsonl``;
at the end rank 0 writes the full parameters to ``OUT/final.pt``. Test instrumentation: ``--die-in-sanity-check W``
makes worker ``W`` (``ELAN_WORKER_ID``) SIGKILL itself in the second batch of the sanity check, where the others meet
its death in the collective of ``sync_dist``; ``--units``: ``ElanFSDPStrategy(shard_modules={nn.Linear})``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401
from lightning_elan.strategy.fsdp import ElanFSDPStrategy

torch.set_default_dtype(torch.float64)
SAMPLES = 96


class Regression(Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, out: Path, dies: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.out, self.dies = out, dies

    def training_step(self, batch: tuple, batch_index: int) -> torch.Tensor:
        index, x, y = batch
        with open(self.out / f"trained-{os.getpid()}.jsonl", "a") as trained:
            trained.write(json.dumps({"epoch": self.current_epoch, "samples": index.tolist()}) + "\n")
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple, batch_index: int) -> None:
        if self.trainer.sanity_checking and batch_index == 1 and os.environ.get("ELAN_WORKER_ID") == self.dies:
            os.kill(os.getpid(), signal.SIGKILL)
        _, x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Regression(SAMPLES), batch_size=12)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Regression(48), batch_size=6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-in-sanity-check", default=None)
    parser.add_argument("--units", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    strategy = ElanFSDPStrategy(shard_modules={nn.Linear}) if args.units else "elan_fsdp"
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Model(args.out, args.die_in_sanity_check)
    trainer.fit(model)
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in model.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(state, args.out / "final.pt")


if __name__ == "__main__":
    main()
