"""Training resumed with ``fit(ckpt_path=...)`` from a checkpoint another job wrote (maybe with another number of
processes), in the classic ``pytorch_lightning`` package. A checkpoint is written at the end of every epoch.

    python resume_other_world.py OUT --batch-size B --max-epochs E [--resume CKPT]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan" with pytorch_lightning too)


class Wave(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(5)
        self.x = torch.rand(size, 2, generator=generator, dtype=torch.float64) * 6 - 3
        self.y = torch.sin(self.x[:, :1]) * torch.cos(self.x[:, 1:])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class WaveModel(pl.LightningModule):
    def __init__(self, lr: float = 0.03) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 20), torch.nn.Tanh(), torch.nn.Linear(20, 20),
                                       torch.nn.Tanh(), torch.nn.Linear(20, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 3], gamma=0.5)
        return [optimizer], [scheduler]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()

    pl.seed_everything(9)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=args.max_epochs, default_root_dir=args.out,
                         logger=CSVLogger(args.out / "logs", name="wave"), log_every_n_steps=1,
                         callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1)],
                         enable_progress_bar=False, enable_model_summary=False)
    train = DataLoader(Wave(96), batch_size=args.batch_size, shuffle=True)
    trainer.fit(WaveModel(), train, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
