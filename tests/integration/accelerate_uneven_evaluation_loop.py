"""An Accelerate loop with ``DataLoaderConfiguration(even_batches=False)`` (``python
accelerate_uneven_evaluation_loop.py OUT``): each process evaluates its shard of 8 validation batches, keeps its
errors locally and gathers them once after the pass (``gather_for_metrics(..., use_gather_object=True)``), as
Accelerate's ``multi_process_metrics.py`` suggests for uneven shards.

Each worker writes ``OUT/record-<worker>.json``: the validation loss and the samples gathered after each epoch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

WORKER = os.environ.get("ELAN_WORKER_ID", "alone")


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(torch.arange(samples), x, x.sum(1, keepdim=True))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    set_seed(0)
    model = torch.nn.Linear(6, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train, validation = DataLoader(data(64, 1), batch_size=4), DataLoader(data(32, 2), batch_size=4)
    model, optimizer, train, validation = accelerator.prepare(model, optimizer, train, validation)
    evaluations = []
    for _ in accelerator.epochs(3):
        for _, x, y in train:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.1)
        errors: list[tuple[int, float]] = []
        for index, x, y in validation:
            with torch.no_grad():
                errors.extend(zip(index.tolist(), (model(x) - y).pow(2).flatten().tolist(), strict=True))
        gathered = accelerator.gather_for_metrics(errors, use_gather_object=True)
        evaluations.append({"loss": sum(error for _, error in gathered) / len(gathered),
                            "samples": sorted(index for index, _ in gathered)})
    (out / f"record-{WORKER}.json").write_text(json.dumps({"evaluations": evaluations, "left": accelerator.has_left}))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
