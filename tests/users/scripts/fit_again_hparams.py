"""Train, look at the result, then train on with the same Trainer; reload the best model from its checkpoint.

    python fit_again_hparams.py OUT

The module stores its arguments with ``self.save_hyperparameters()`` and clips only its head's gradients in its own
``configure_gradient_clipping``. ``trainer.fit`` runs 2 epochs; then ``trainer.fit_loop.max_epochs`` is raised to 4
and ``trainer.fit`` is called again with the same model and loader (it continues from epoch 2). After that,
``Regressor.load_from_checkpoint`` loads ``ModelCheckpoint``'s best file (hyperparameters included) and
``trainer.validate`` evaluates it; ``OUT/result.json`` holds the stages' steps, the reloaded hyperparameters and the
validation loss. Float64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Wave(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = torch.cos(self.x.sum(1, keepdim=True)) - self.x[:, :1] ** 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.01, head_clip: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.SiLU()).double()
        self.head = torch.nn.Linear(hidden, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.hparams.head_clip)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(out: Path) -> None:
    pl.seed_everything(23)
    train = DataLoader(Wave(96, 0), batch_size=6, shuffle=True)
    val = DataLoader(Wave(36, 1), batch_size=6)
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=1,
                                 filename="best-{epoch}-{step}")
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                         logger=CSVLogger(out / "logs", name="again"), callbacks=[checkpoint])
    model = Regressor(hidden=16, lr=0.02)
    trainer.fit(model, train, val)
    first = trainer.global_step
    trainer.fit_loop.max_epochs = 4
    trainer.fit(model, train, val)
    best = Regressor.load_from_checkpoint(checkpoint.best_model_path)
    validated = trainer.validate(best, val, verbose=False)
    if trainer.is_global_zero:
        result = {"first_fit_steps": first, "steps": trainer.global_step, "epoch": trainer.current_epoch,
                  "best": Path(checkpoint.best_model_path).name, "hparams": dict(best.hparams),
                  "validate": validated}
        (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
