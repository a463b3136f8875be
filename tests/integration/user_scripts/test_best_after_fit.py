"""An ordinary user's Lightning script: fit with ``ModelCheckpoint(monitor="val_loss")``, then
``trainer.test(ckpt_path="best")``, as Lightning's docs show. It knows nothing of lightning_elan beyond
``strategy="elan"``.

python test_best_after_fit.py OUT [--die-testing]

Every process that tests writes ``OUT/tested-<pid>.json`` (its rank and the test results). ``--die-testing``: the
process of rank 1 SIGKILLs itself at the test's second batch."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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
        if "--die-testing" in sys.argv and self.global_rank == 1 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1)
    model = Regressor()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False,
                         callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss")],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True), DataLoader(dataset(20, 1), batch_size=5))
    tested = trainer.test(model, DataLoader(dataset(30, 2), batch_size=5), ckpt_path="best")
    (out / f"tested-{os.getpid()}.json").write_text(json.dumps({"rank": trainer.global_rank, "results": tested}))
