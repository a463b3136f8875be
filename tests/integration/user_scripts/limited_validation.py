"""An ordinary user's Lightning script that validates a part of its validation set: ``limit_val_batches=3`` and
``limit_test_batches=2`` (batches per process, as Lightning counts them), validation twice an epoch, a test after
``fit``. It knows nothing of lightning_elan beyond ``strategy="elan"``.

python limited_validation.py OUT [--whole]

``--whole``: no limits, every validation and test sample is evaluated (40 of each, batches of 5).

Writes ``OUT/logs/metrics.csv`` (CSVLogger) and, on rank 0, ``OUT/final.pt`` (the parameters) and
``OUT/tested.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
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

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    limits = {} if "--whole" in sys.argv[2:] else {"limit_val_batches": 3, "limit_test_batches": 2}
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Regressor()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, val_check_interval=0.5,
                         **limits, log_every_n_steps=1,
                         logger=CSVLogger(out, name="logs", version=""), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True), DataLoader(dataset(40, 1), batch_size=5))
    tested = trainer.test(model, DataLoader(dataset(40, 2), batch_size=5))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()}, out / "final.pt")
        (out / "tested.json").write_text(json.dumps(tested))
