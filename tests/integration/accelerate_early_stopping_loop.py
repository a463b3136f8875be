"""Accelerate's ``examples/by_feature/early_stopping.py``, small and on the CPU (``python
accelerate_early_stopping_loop.py OUT``): after each epoch's evaluation (``gather_for_metrics``) the main process calls
``set_trigger()`` once the validation loss stops improving by 10%, and every process leaves the loop when
``check_trigger()`` says so. Before it leaves, each process other than the main one writes its own summary, which takes
a second (a slow disk); the main process goes on at once to ``wait_for_everyone()``.

Each worker writes ``OUT/record-<worker>.json``: the samples it trained per epoch, the validation losses, the epoch it
stopped after, the optimizer steps and the final parameters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, VALIDATION, EPOCHS, BATCH = 64, 24, 8, 4
WORKER = os.environ.get("ELAN_WORKER_ID", "alone")


class Regression(Dataset):
    def __init__(self, samples: int, seed: int) -> None:
        weights = torch.randn(6, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
        self.y = self.x @ weights + 0.3 * torch.randn(samples, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train = DataLoader(Regression(SAMPLES, 1), batch_size=BATCH, shuffle=True)
    validation = DataLoader(Regression(VALIDATION, 2), batch_size=BATCH)
    model, optimizer, train, validation = accelerator.prepare(model, optimizer, train, validation)
    trained: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    best, stopped_after = float("inf"), None
    for epoch in accelerator.epochs(EPOCHS):
        model.train()
        for index, x, y in train:
            if accelerator.sample_weight > 0:
                trained.setdefault(epoch, []).extend(index.tolist())
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.1)
        model.eval()
        errors = []
        for _, x, y in validation:
            with torch.no_grad():
                errors.append(accelerator.gather_for_metrics((model(x) - y).pow(2)))
        losses[epoch] = loss = torch.cat(errors).mean().item()
        if accelerator.is_main_process:
            if loss > 0.9 * best:
                accelerator.set_trigger()
            best = min(best, loss)
        if accelerator.check_trigger():
            stopped_after = epoch
            if not accelerator.is_main_process:
                time.sleep(1.0)  # this process's own summary, on a slow disk
            break
    parameters = [parameter.detach().flatten().tolist() for parameter in accelerator.unwrap_model(model).parameters()]
    record = {"trained": trained, "losses": losses, "stopped_after": stopped_after, "left": accelerator.has_left,
              "optimizer_steps": accelerator.optimizer_steps, "parameters": parameters}
    (out / f"record-{WORKER}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
