"""An ordinary user's Lightning script that does things after ``fit``: it writes a file per process, tests the model
and writes the results, and a ``try/finally`` around all of it writes a marker. It knows nothing of lightning_elan
beyond ``strategy="elan"`` (its log at INFO, as many scripts set it).

    python after_fit_outputs.py OUT

Every process prints ``rank R pid P trained step S`` after each training batch and writes, by its pid:
``OUT/after-fit-P.json`` (right after ``fit``: its rank, world size, global step and a digest of its parameters),
``OUT/tested-P.json`` (``trainer.test``'s results) and, in its ``finally:``, ``OUT/finally-P.json``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401

STEP_SLEEP_S = 0.05


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
        time.sleep(STEP_SLEEP_S)
        return self.loss(batch)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        print(f"rank {self.global_rank} pid {os.getpid()} trained step {self.trainer.global_step}", flush=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def write(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content))


def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    try:
        pl.seed_everything(1)
        model = Regressor()
        trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(dataset(120, 0), batch_size=4, shuffle=True))
        digest = [round(value, 12) for value in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]
        write(out / f"after-fit-{pid}.json", {"rank": trainer.global_rank, "world_size": trainer.world_size,
                                              "global_step": trainer.global_step, "parameters": digest})
        tested = trainer.test(model, DataLoader(dataset(30, 2), batch_size=5), verbose=False)
        write(out / f"tested-{pid}.json", {"rank": trainer.global_rank, "results": tested})
    finally:
        write(out / f"finally-{pid}.json", {"pid": pid})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
