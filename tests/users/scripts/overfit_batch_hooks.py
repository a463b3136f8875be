"""Debug a model the way Lightning's docs suggest: overfit a couple of batches, check the whole validation set first.

    python overfit_batch_hooks.py OUT

``Trainer(overfit_batches=2)`` (Lightning trains on the first 2 batches of each epoch, its sampler made sequential;
validation on 2 batches too), ``num_sanity_val_steps=-1`` (the sanity check runs the whole validation loader);
the batch goes through ``on_before_batch_transfer`` (a dict made of the dataset's tuple), ``transfer_batch_to_device``
(moved by hand) and ``on_after_batch_transfer`` (inputs standardised). 8 epochs; ``OUT/logs/overfit/version_0``
holds the losses; ``OUT/hooks.json`` counts each hook's calls on rank 0. Float64.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Spiral(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        t = torch.rand(size, generator=generator, dtype=torch.float64) * 6
        self.x = torch.stack([t.cos() * t, t.sin() * t], 1) + 3.0
        self.y = (t > 3).to(torch.float64).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).double()
        self.calls: Counter = Counter()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict[str, torch.Tensor]:
        self.calls["before_transfer"] += 1
        index, x, y = batch
        return {"index": index, "x": x, "y": y}

    def transfer_batch_to_device(self, batch: dict[str, torch.Tensor], device: torch.device,
                                 dataloader_idx: int) -> dict[str, torch.Tensor]:
        self.calls["transfer"] += 1
        return {key: value.to(device) for key, value in batch.items()}

    def on_after_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        self.calls["after_transfer"] += 1
        return {**batch, "x": (batch["x"] - 3.0) / 3.0}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def main(out: Path) -> None:
    pl.seed_everything(31)
    model = Classifier()
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=8, overfit_batches=2,
                         num_sanity_val_steps=-1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="overfit"))
    trainer.fit(model, DataLoader(Spiral(96, 0), batch_size=6, shuffle=True),
                DataLoader(Spiral(48, 1), batch_size=6))
    if trainer.is_global_zero:
        (out / "hooks.json").write_text(json.dumps({"steps": trainer.global_step, **model.calls}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
