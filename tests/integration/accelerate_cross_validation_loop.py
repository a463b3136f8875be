"""An Accelerate loop after Accelerate's ``examples/by_feature/cross_validation.py`` (``python
accelerate_cross_validation_loop.py OUT``): two folds, each with its own model, optimizer and loaders prepared, its own
``for epoch in accelerator.epochs(2)`` loop, an evaluation with ``gather_for_metrics`` and ``free_memory()`` after it.

Each worker appends to ``OUT/folds-<worker>.jsonl`` after each fold: the training samples it trained and the
validation samples gathered.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

WORKER = os.environ.get("ELAN_WORKER_ID", "alone")
SAMPLES, FOLDS = 32, 2


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(torch.arange(samples), x, x.sum(1, keepdim=True))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    dataset = data(SAMPLES, 1)
    for fold in range(FOLDS):
        set_seed(fold)
        train = DataLoader(Subset(dataset, [i for i in range(SAMPLES) if i % FOLDS != fold]), batch_size=4)
        validation = DataLoader(Subset(dataset, [i for i in range(SAMPLES) if i % FOLDS == fold]), batch_size=4)
        model = torch.nn.Linear(6, 1).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, train, validation = accelerator.prepare(model, optimizer, train, validation)
        trained: list[int] = []
        for _ in accelerator.epochs(2):
            for index, x, y in train:
                trained.extend(index.tolist())
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        gathered: list[int] = []
        for index, _x, _y in validation:
            gathered.extend(accelerator.gather_for_metrics(index).tolist())
        with open(out / f"folds-{WORKER}.jsonl", "a") as folds:
            folds.write(json.dumps({"fold": fold, "trained": trained, "validated": gathered}) + "\n")
        model, optimizer, train, validation = accelerator.free_memory(model, optimizer, train, validation)
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
