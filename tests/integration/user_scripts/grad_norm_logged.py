"""A user's script that logs its gradient norm from ``on_before_optimizer_step`` with ``self.log(..., sync_dist=True)``
(Lightning's docs log norms there; ``sync_dist`` makes it an all-reduce between the backward and the update): a float64
regressor, SGD, 2 epochs of 96 samples.

    python grad_norm_logged.py OUT [--strategy elan|elan_fsdp] [--clip C] [--kill-step S]

``--kill-step S``: rank 1 SIGKILLs itself in ``on_before_optimizer_step`` of step S, before its own ``self.log`` (the
others meet its death in that all-reduce, or under ``elan_fsdp`` with ``--clip`` in the clipping's norm all-reduce).
Rank 0 writes the final parameters to ``OUT/final.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers strategy="elan" and "elan_fsdp")


class Regressor(pl.LightningModule):
    def __init__(self, out: Path, kill_step: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.out, self.kill_step = out, kill_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        if self.global_step == self.kill_step and self.global_rank == 1 and not (self.out / "killed").exists():
            (self.out / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        norm = torch.stack([p.grad.norm() for p in self.parameters()]).norm()
        self.log("grad_norm", norm.full_tensor() if hasattr(norm, "full_tensor") else norm, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="elan")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=generator)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", max_epochs=2, gradient_clip_val=args.clip,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regressor(args.out, args.kill_step)
    trainer.fit(model, DataLoader(data, batch_size=6, shuffle=True))
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in model.state_dict().items()}  # every member gathers under elan_fsdp
    if trainer.is_global_zero:
        torch.save(state, args.out / "final.pt")


if __name__ == "__main__":
    main()
