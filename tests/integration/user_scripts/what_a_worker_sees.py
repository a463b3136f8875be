"""An ordinary user's Lightning script that, first thing, writes down what its process looks like from the inside
(``python what_a_worker_sees.py OUT``): its ``sys.argv``, ``__name__``, ``__file__``, ``sys.path[0]``, command line,
environment, signal mask, parent, and a draw from ``random`` and numpy's global generator; then it trains a small
regression. It knows nothing of lightning_elan but ``strategy="elan"``."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401


def what_this_process_sees() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "main_file": sys.modules["__main__"].__file__,
        "path0": sys.path[0],
        "cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0"),
        "worker": os.environ.get("ELAN_WORKER_ID"),
        "pythonpath": os.environ.get("PYTHONPATH"),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "unexpected_vars": sorted(key for key in os.environ if key.startswith("ELAN_PRELOAD")),
        "blocked_signals": status["SigBlk"].strip(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "random": random.random(),
        "numpy": float(np.random.rand()),
        "torch_threads": torch.get_num_threads(),
    }


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seen = what_this_process_sees()
    (out / f"seen-{seen['worker']}.json").write_text(json.dumps(seen))
    x = torch.randn(240, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=out, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader)
