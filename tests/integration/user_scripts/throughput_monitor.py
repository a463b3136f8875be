"""An ordinary user's Lightning script with Lightning's ``ThroughputMonitor`` (samples and batches per second logged
by rank 0) and a ``validate`` after ``fit``. It knows nothing of lightning_elan beyond ``strategy="elan"``.

python throughput_monitor.py OUT

Writes ``OUT/logs/metrics.csv`` (CSVLogger), ``OUT/validated-<pid>.json`` on every process and, on rank 0,
``OUT/final.pt`` (the parameters)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1).double()

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Regressor()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, log_every_n_steps=1,
                         callbacks=[ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]))],
                         logger=CSVLogger(out, name="logs", version=""), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True), DataLoader(dataset(20, 1), batch_size=5))
    validated = trainer.validate(model, DataLoader(dataset(20, 1), batch_size=5))
    (out / f"validated-{os.getpid()}.json").write_text(json.dumps({"rank": trainer.global_rank, "results": validated}))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()}, out / "final.pt")
