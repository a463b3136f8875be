"""A user's script with its own precision plugin whose ``optimizer_step`` runs the closure itself and skips the update
when the loss is not finite (a pattern from mixed-precision code), as Lightning lets a ``Precision`` subclass do: it
never calls ``Precision._after_closure``. A float64 regressor, SGD, 2 epochs of 96 samples.

    python custom_precision.py OUT [--strategy elan|elan_fsdp] [--kill-step S]

``--kill-step S``: rank 1 SIGKILLs itself in the plugin's ``optimizer_step`` of step S, after the closure (its
gradients were all-reduced), before the update.

Rank 0 writes the final parameters to ``OUT/final.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers strategy="elan" and "elan_fsdp")


class SkipNonFiniteSteps(Precision):
    def __init__(self, out: Path, kill_step: int | None) -> None:
        super().__init__()
        self.out, self.kill_step = out, kill_step

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        loss = closure()
        if loss is not None and not torch.isfinite(loss):
            return loss
        trainer = model.trainer
        if trainer.global_step == self.kill_step and trainer.global_rank == 1 and not (self.out / "killed").exists():
            (self.out / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return optimizer.step(**kwargs)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="elan")
    parser.add_argument("--kill-step", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(5)
    x = torch.randn(96, 4)
    data = TensorDataset(x, (x[:, :1] * x[:, 1:2]).tanh())
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[SkipNonFiniteSteps(args.out, args.kill_step)])
    model = Regressor()
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, args.out / "final.pt")


if __name__ == "__main__":
    main()
