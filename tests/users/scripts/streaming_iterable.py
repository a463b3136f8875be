"""Training data streamed from an ``IterableDataset`` (records read one after another, no random access).

    python streaming_iterable.py OUT

``Stream`` yields ``(index, x, y)`` records, split between the DataLoader's workers with ``get_worker_info`` as
torch's docs show; 2 loader workers, batches of 6. Float64; ``OUT/logs/stream/version_0`` holds the losses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Stream(IterableDataset):
    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        per_worker = math.ceil(self.size / (worker.num_workers if worker else 1))
        start = (worker.id if worker else 0) * per_worker
        for index in range(start, min(start + per_worker, self.size)):
            x = torch.randn(3, generator=torch.Generator().manual_seed(self.seed + index), dtype=torch.float64)
            yield index, x, x.sum(0, keepdim=True).tanh()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(53)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="stream"))
    trainer.fit(Model(), DataLoader(Stream(96, 0), batch_size=6, num_workers=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
