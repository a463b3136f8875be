"""An Accelerate loop after Accelerate's ``examples/by_feature/local_sgd.py`` (``python accelerate_local_sgd_loop.py
OUT``): ``LocalSGD(local_sgd_steps=4)`` around the epoch loop (each process steps its own model, the models are averaged
every 4 steps and at the end), ``DataLoaderConfiguration(split_batches=True)`` with a global batch of 8, and an
evaluation after every epoch that gathers each validation sample's error with ``gather_for_metrics``.

The main process holds each step until the joiners of a request due then are ready, so an ``add`` lands at its step.
Each worker writes ``OUT/batches-<worker>.jsonl`` (every batch it trained, with where it was cut from) and
``OUT/record-<worker>.json``: the samples each evaluation gathered, its ``LocalSGD``'s count of steps and its final
parameters (after the last averaging).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate.local_sgd import LocalSGD
from accelerate.utils import DataLoaderConfiguration, set_seed
from accelerate_probe import wait_for_joiners_due_at
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

WORKER = os.environ.get("ELAN_WORKER_ID", "alone")


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(torch.arange(samples), x, (x * torch.arange(1, 7)).sum(1, keepdim=True))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    set_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    train = DataLoader(data(48, 1), batch_size=8, shuffle=True)
    validation = DataLoader(data(20, 2), batch_size=8)
    model, optimizer, train, validation = accelerator.prepare(model, optimizer, train, validation)
    batches = open(out / f"batches-{WORKER}.jsonl", "a")
    evaluations = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4, enabled=True) as local_sgd:
        for _ in accelerator.epochs(2):
            model.train()
            for index, x, y in train:
                position = accelerator.data_position
                batches.write(json.dumps({"epoch": position.epoch, "position": position.position,
                                          "generation": accelerator.generation,
                                          "indices": index.tolist() if accelerator.sample_weight > 0 else []}) + "\n")
                batches.flush()
                if accelerator.is_main_process:
                    wait_for_joiners_due_at(accelerator.optimizer_steps + 1, lambda: accelerator.engine.peer_failed)
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            model.eval()
            gathered = []
            for index, x, _y in validation:
                with torch.no_grad():
                    model(x)
                gathered.extend(accelerator.gather_for_metrics(index).tolist())
            evaluations.append({"world": accelerator.num_processes, "samples": gathered})
    parameters = [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]
    record = {"worker": WORKER, "left": accelerator.has_left, "evaluations": evaluations,
              "local_sgd_steps": local_sgd.num_steps, "parameters": parameters}
    (out / f"record-{WORKER}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
