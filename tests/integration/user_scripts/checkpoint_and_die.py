"""An ordinary user's Lightning script that saves a checkpoint at every epoch's end and may SIGKILL itself once while
it saves: a model, a CSV logger, an epoch mean of the loss synced over the processes, ``ModelCheckpoint`` (every
epoch, ``save_last``). It knows nothing of lightning_elan's internals; only ``strategy="elan"``.

python checkpoint_and_die.py OUT [--die-saving EPOCH:RANK]

``--die-saving``: the process of rank RANK SIGKILLs itself in a callback's ``on_save_checkpoint`` of the save at the
end of epoch EPOCH (once per job: ``OUT/died`` marks it). At the end rank 0 writes ``OUT/final.pt`` (the parameters)
and ``OUT/final.json`` (the step counters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 5, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x @ torch.arange(1.0, 6.0, dtype=torch.float64) + 0.1)


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 1).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class DieWhileSaving(Callback):
    def __init__(self, out: Path, point: tuple[int, int] | None):
        self.out, self.point = out, point

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        marker = self.out / "died"
        if self.point == (trainer.current_epoch, trainer.global_rank) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-saving")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    point = None if args.die_saving is None else tuple(int(part) for part in args.die_saving.split(":"))
    pl.seed_everything(1)
    model = Regressor()
    trainer = pl.Trainer(
        strategy="elan", accelerator="cpu", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(args.out, name="logs", version=""),
        callbacks=[DieWhileSaving(args.out, point),
                   ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1, save_last=True,
                                   filename="{epoch}-{step}")],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(72, 0), batch_size=4, shuffle=True))
    if trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in model.state_dict().items()},
                   args.out / "final.pt")
        (args.out / "final.json").write_text(json.dumps({"global_step": trainer.global_step,
                                                         "epoch": trainer.current_epoch}))
