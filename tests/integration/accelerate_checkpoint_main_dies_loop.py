"""An Accelerate loop that checkpoints after each epoch, as ``examples/by_feature/checkpointing.py`` does
(``python accelerate_checkpoint_main_dies_loop.py OUT [DIE_EPOCH]``): ``save_state(OUT/state-<epoch>)`` on every
process (no collective in it: Accelerate's main process writes the model, optimizer and registered objects, each
process its RNG state), then an evaluation with ``gather_for_metrics``. With DIE_EPOCH, worker w0 (the main process)
is SIGKILLed right before its ``save_state`` of that epoch.

Each worker writes ``OUT/record-<worker>.json`` with its final parameters.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

WORKER = os.environ.get("ELAN_WORKER_ID", "alone")


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True))


def main(out: Path, die_epoch: int | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Linear(6, 1).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    train, validation = DataLoader(data(64, 1), batch_size=4), DataLoader(data(16, 2), batch_size=4)
    model, optimizer, train, validation = accelerator.prepare(model, optimizer, train, validation)
    for epoch in accelerator.epochs(3):
        for x, y in train:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.1)
        if epoch == die_epoch and WORKER == "w0":
            os.kill(os.getpid(), signal.SIGKILL)
        accelerator.save_state(str(out / f"state-{epoch}"))
        with torch.no_grad():
            errors = [accelerator.gather_for_metrics((model(x) - y).pow(2)) for x, y in validation]
        accelerator.print(f"epoch {epoch}: validation loss {torch.cat(errors).mean().item():.6f}")
    parameters = [parameter.detach().flatten().tolist() for parameter in accelerator.unwrap_model(model).parameters()]
    (out / f"record-{WORKER}.json").write_text(json.dumps({"parameters": parameters}))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
