"""Collectives where the fit begins and where it ends, and a process group destroyed at the script's end.

    python fit_bounds_collectives.py OUT

The LightningModule scales its inputs by statistics computed once per fit: in ``on_fit_start`` the largest magnitude
of each feature, every process taking its strided share (``global_rank::world_size``) and ``self.all_gather``-ing
the shares' maxima, then ``torch.distributed.barrier()``; in ``on_train_start`` the targets' mean and spread, the
shares' sums added up by ``trainer.strategy.reduce(..., "sum")``, and the number of samples, counted with
``torch.distributed.all_reduce`` as a script ported from plain DDP does. They are plain attributes (recomputed by every
fit, also a resumed one). A callback names the run in its ``on_fit_start``: rank 0 draws a random id and
``trainer.strategy.broadcast``s it.

Code ported from a DDP script: ``setup`` has rank 0 (``torch.distributed.get_rank()``) make the output directory
while the others wait in ``torch.distributed.barrier()``, and ``on_fit_start`` collects every process's host name with
``torch.distributed.all_gather_object``.

In ``on_fit_end`` rank 0 writes ``OUT/summary.json`` (the run id, the steps, the number of processes, counted by a
reduction) and every process reads it after ``trainer.strategy.barrier()``. In ``teardown`` each process waits for
the others (``torch.distributed.barrier()``) and writes what it saw to ``OUT/teardown/<pid>.json``. The script ends
with ``torch.distributed.destroy_process_group()`` in a ``finally:`` (torch asks for it before exit).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Features(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        scales = torch.tensor([1.0, 4.0, 0.25, 2.0], dtype=torch.float64)
        self.x = torch.round(torch.randn(size, 4, generator=generator, dtype=torch.float64) * scales * 64) / 64
        self.y = torch.round((self.x[:, :2].sum(dim=1, keepdim=True).sin() * 3 + 2) * 64) / 64

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class RunName(pl.Callback):
    """Rank 0 names the run; every process takes its name."""

    def __init__(self) -> None:
        self.run_id = ""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run_id = trainer.strategy.broadcast(uuid.uuid4().hex)


class Scaled(pl.LightningModule):
    def __init__(self, out: Path, run_name: RunName) -> None:
        super().__init__()
        self.out = out
        self.run_name = run_name
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        self.x_scale = torch.ones(4, dtype=torch.float64)
        self.y_mean, self.y_std = 0.0, 1.0
        self.samples = 0

    def setup(self, stage: str) -> None:
        if dist.get_rank() == 0:
            (self.out / "teardown").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        assert (self.out / "teardown").is_dir()

    def _share(self) -> Features:
        return self.trainer.train_dataloader.dataset

    def on_fit_start(self) -> None:
        data = Features(96, 2)  # the loaders are not built yet
        share = data.x[self.global_rank::self.trainer.world_size]
        maxima = self.all_gather(share.abs().amax(dim=0))
        self.x_scale = maxima.reshape(-1, 4).amax(dim=0)
        dist.barrier()
        self.hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())

    def on_train_start(self) -> None:
        share = self._share().y[self.global_rank::self.trainer.world_size]
        parts = torch.stack([share.sum(), share.square().sum(), torch.tensor(len(share), dtype=torch.float64)])
        total, squares, count = self.trainer.strategy.reduce(parts, reduce_op="sum").tolist()
        self.y_mean, self.y_std = total / count, (squares / count - (total / count) ** 2) ** 0.5
        samples = torch.tensor([len(share)], dtype=torch.int64)
        dist.all_reduce(samples)
        self.samples = int(samples.item())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x / self.x_scale), (y - self.y_mean) / self.y_std)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_fit_end(self) -> None:
        processes = self.trainer.strategy.reduce(torch.tensor(1.0, dtype=torch.float64), reduce_op="sum")
        if self.trainer.is_global_zero:
            summary = {"run_id": self.run_name.run_id, "steps": self.trainer.global_step,
                       "processes": int(processes.item()), "x_scale": self.x_scale.tolist(),
                       "y": [self.y_mean, self.y_std]}
            (self.out / "summary.json").write_text(json.dumps(summary))
        self.trainer.strategy.barrier("summary written")
        summary = json.loads((self.out / "summary.json").read_text())
        assert summary["run_id"] == self.run_name.run_id, (summary, self.run_name.run_id)

    def teardown(self, stage: str) -> None:
        if dist.is_initialized():
            dist.barrier()
        seen = {"stage": stage, "global_rank": self.global_rank, "run_id": self.run_name.run_id,
                "world": dist.get_world_size() if dist.is_initialized() else 1, "steps": self.trainer.global_step,
                "samples": self.samples, "hosts": self.hosts}
        (self.out / "teardown").mkdir(exist_ok=True)
        (self.out / "teardown" / f"{os.getpid()}.json").write_text(json.dumps(seen))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Features(96, 2), batch_size=6, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(31)
    run_name = RunName()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="scaled"), callbacks=[run_name])
    try:
        trainer.fit(Scaled(out, run_name))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
