"""Collectives where the training begins, where each epoch begins and where the training ends.

    python epoch_start_collectives.py OUT

The LightningModule standardizes its targets with statistics of the training set computed in ``on_train_start``: each
process sums its strided share (``global_rank::world_size``) and ``trainer.strategy.reduce(..., "sum")`` adds the
shares up; the results live in buffers, so a checkpoint holds them. A callback draws each epoch's augmentation seed
on rank 0 in ``on_train_epoch_start`` and broadcasts it (``trainer.strategy.broadcast``); the module adds noise to
every sample from that seed and the sample's index, and checks in its own ``on_train_epoch_start`` that every process
is in the same epoch (``self.all_gather``). The callback keeps its seed in its ``state_dict``, the module in its
checkpoint. In ``on_train_end`` rank 0 writes ``OUT/summary.json``, and every process reads it after a barrier.
``OUT/seeds.json`` (rank 0, after ``fit``): the seed of every epoch and the statistics. Float64 targets on a 1/64
grid, so the sums are exact.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Grid(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        self.y = torch.round((3 * self.x[:, :2].sum(dim=1, keepdim=True).tanh() + 5) * 64) / 64

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class EpochSeed(pl.Callback):
    """Rank 0 draws the epoch's seed; every process takes it from rank 0."""

    def __init__(self) -> None:
        self.seed = -1
        self.drawn: dict[int, int] = {}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seed = trainer.strategy.broadcast(random.Random(1000 + trainer.current_epoch).randrange(1 << 30))
        self.drawn[trainer.current_epoch] = self.seed
        pl_module.noise_seed = self.seed

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed, self.drawn = state_dict["seed"], {int(k): v for k, v in state_dict["drawn"].items()}


class Standardized(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).double()
        self.register_buffer("y_mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("y_std", torch.ones((), dtype=torch.float64))
        self.noise_seed = -1

    def on_train_start(self) -> None:
        data = self.trainer.train_dataloader.dataset
        share = data.y[self.global_rank::self.trainer.world_size]
        parts = torch.stack([share.sum(), share.square().sum(), torch.tensor(len(share), dtype=torch.float64)])
        total, squares, count = self.trainer.strategy.reduce(parts, reduce_op="sum")
        self.y_mean.fill_(total / count)
        self.y_std.fill_((squares / count - (total / count) ** 2).sqrt())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["noise_seed"] = self.noise_seed

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.noise_seed = checkpoint["noise_seed"]

    def on_train_epoch_start(self) -> None:
        epochs = self.all_gather(torch.tensor(self.current_epoch))
        assert bool((epochs == self.current_epoch).all()), f"processes in different epochs: {epochs.tolist()}"

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            summary = {"mean": self.y_mean.item(), "std": self.y_std.item(), "steps": self.trainer.global_step}
            (self.out / "summary.json").write_text(json.dumps(summary))
        self.trainer.strategy.barrier("summary written")
        summary = json.loads((self.out / "summary.json").read_text())
        assert summary["steps"] == self.trainer.global_step, summary

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        noise = torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(self.noise_seed * 997 + int(i)),
                                         dtype=torch.float64) for i in index])
        target = (y - self.y_mean) / self.y_std
        loss = torch.nn.functional.mse_loss(self.net(x + 0.05 * noise), target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Grid(96, 2), batch_size=6, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(23)
    model, seeds = Standardized(out), EpochSeed()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="seeded"), callbacks=[seeds])
    trainer.fit(model)
    if trainer.is_global_zero:
        result = {"drawn": seeds.drawn, "mean": model.y_mean.item(), "std": model.y_std.item()}
        (out / "seeds.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
