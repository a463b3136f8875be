"""An ordinary user's Lightning script that keeps running statistics in buffers updated by ``training_step``: an
exponential moving average of the first layer's weight norm (``register_buffer``, updated in place) and a count of
the batches trained (a non-persistent buffer, replaced by assignment). float64, a CSV logger, ``strategy="elan"``;
nothing else of lightning_elan.

python ema_buffer.py OUT [--die-at STEP]

``--die-at STEP``: the process that is rank 1 SIGKILLs itself once (``OUT/died`` marks it) between the forward and the
backward of the batch at global step STEP: rank 0 has run that ``training_step`` (its buffers updated) and meets the
death in the gradient all-reduce.

At the end rank 0 writes ``OUT/final.pt`` (the state dict, buffers included, and ``seen``)."""

from __future__ import annotations

import os
import signal
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
    x = torch.randn(samples, 5, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


class Regressor(pl.LightningModule):
    def __init__(self, out: Path, die_at: int | None) -> None:
        super().__init__()
        self.out, self.die_at = out, die_at
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.register_buffer("ema_norm", torch.zeros((), dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        with torch.no_grad():
            self.ema_norm.mul_(0.9).add_(0.1 * self.net[0].weight.norm())
            self.seen = self.seen + 1
        self.log("train_loss", loss, sync_dist=True)
        self.log("ema_norm", self.ema_norm)
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.die_at == self.trainer.global_step and self.global_rank == 1 and not (self.out / "died").exists():
            (self.out / "died").touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    die_at = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else None
    pl.seed_everything(1)
    model = Regressor(out, die_at)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, log_every_n_steps=1,
                         logger=CSVLogger(out, name="logs", version=""), limit_val_batches=0,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(96, 0), batch_size=6, shuffle=True))
    if trainer.is_global_zero:
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
        torch.save({**state, "seen": model.seen.clone()}, out / "final.pt")
