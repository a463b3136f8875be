"""Accelerate's ``examples/by_feature/memory.py`` and ``tracking.py``, small and on the CPU (``python
accelerate_executable_batch_loop.py OUT START``): the training function is wrapped in ``find_executable_batch_size``
(starting at per-process batch START), which prepares the model, optimizer and loader again at each try; a batch
of more than 4 samples on a worker fails its forward with the out-of-memory error a GPU would raise, so the decorator
retries at a smaller size. A custom tracker (``main_process_only``, as Accelerate's own) appends the rows it is given to
``OUT/tracker.jsonl`` with the worker that wrote them.

The main process holds each step until the joiners of a request due then are ready, so an ``add`` lands at its step
(on a loaded machine a joiner's start-up could outlast the 36 steps, and it would never join).

Each worker writes ``OUT/record-<worker>.json``: the batch sizes tried, the samples it trained per epoch, the optimizer
steps and the final parameters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.utils import find_executable_batch_size, set_seed
from accelerate_probe import wait_for_joiners_due_at  # a sibling module (this script's folder is first on sys.path)
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, EPOCHS, FITS = 96, 3, 4
WORKER = os.environ.get("ELAN_WORKER_ID", "alone")


class FileTracker(GeneralTracker):
    name = "file"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> Path:
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._append({"config": values})

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._append({"step": step, **values})

    def _append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({**row, "worker": WORKER}) + "\n")


class Regression(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 6, generator=generator, dtype=torch.float64)
        self.y = self.x @ torch.randn(6, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def main(out: Path, start: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, log_with=[FileTracker(out / "tracker.jsonl")])
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)
    accelerator.init_trackers("executable_batch", config={"lr": 0.03})
    tried: list[int] = []
    trained: dict[int, list[int]] = {}

    @find_executable_batch_size(starting_batch_size=start)
    def inner_training_loop(batch_size: int) -> None:
        nonlocal model, optimizer
        tried.append(batch_size)
        trained.clear()
        train = DataLoader(Regression(), batch_size=batch_size, shuffle=True)
        model, optimizer, train = accelerator.prepare(model, optimizer, train)
        for epoch in accelerator.epochs(EPOCHS):
            for index, x, y in train:
                if accelerator.is_main_process:
                    wait_for_joiners_due_at(accelerator.optimizer_steps + 1, lambda: accelerator.engine.peer_failed)
                prediction = model(x)
                if x.shape[0] > FITS:
                    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on the CPU)")
                if accelerator.sample_weight > 0:
                    trained.setdefault(epoch, []).extend(index.tolist())
                loss = torch.nn.functional.mse_loss(prediction, y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                accelerator.log({"loss": accelerator.reduce(loss.detach(), "mean").item()},
                                step=accelerator.optimizer_steps)

    inner_training_loop()
    parameters = [parameter.detach().flatten().tolist() for parameter in accelerator.unwrap_model(model).parameters()]
    record = {"tried": tried, "trained": trained, "optimizer_steps": accelerator.optimizer_steps,
              "left": accelerator.has_left, "parameters": parameters}
    (out / f"record-{WORKER}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
