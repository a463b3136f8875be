"""An Accelerate loop accumulating gradients by hand, as Accelerate's gradient accumulation guide shows it "without
``accumulate()``" (``python accelerate_manual_accumulation_loop.py OUT [--kill WORKER:STEP]``): a local ``enumerate``
counter picks the micro-batches whose backward runs under ``accelerator.no_sync(model)`` and the one that steps::

    for i, batch in enumerate(train):
        if (i + 1) % 2 != 0:
            with accelerator.no_sync(model):
                accelerator.backward(loss_of(model(batch)))
        else:
            accelerator.backward(loss_of(model(batch)))
            optimizer.step(); optimizer.zero_grad()

``--kill WORKER:STEP``: that worker SIGKILLs itself right after the no_sync backward of the first micro-batch of
optimizer step STEP (counted over the job): the others meet the death between the window's two micro-batches.
``--pause S``: each micro-batch lasts S seconds more (time for a replacement to join).

Under `elan run` each worker appends each micro-batch it takes to ``OUT/batches-<worker>.jsonl`` (the epoch, the job's
position and generation, its sample indices: a killed worker's too) and writes ``OUT/record-<worker>.json`` at its end
(the job's optimizer steps); the main process saves ``final.pt``.
``--plain``: a plain ``Accelerator``, its processes started as torchrun starts them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

WORKER = os.environ.get("ELAN_WORKER_ID") or f"plain{os.environ.get('RANK', '0')}"
SAMPLES, BATCH, EPOCHS, WINDOW = 96, 4, 3, 2


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(torch.arange(SAMPLES), x, (x * torch.arange(1, 7)).sum(1, keepdim=True))


def micro_batch(accelerator: ElasticAccelerator, index: torch.Tensor) -> dict[str, Any]:
    """Where the job's position was when this worker took this micro-batch, and its samples."""
    position = accelerator.data_position
    return {"epoch": position.epoch, "position": position.position, "generation": accelerator.generation,
            "indices": index.tolist() if accelerator.sample_weight > 0 else []}


def main(out: Path, plain: bool, kill: str | None, pause: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True) if plain else ElasticAccelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer, train = accelerator.prepare(model, optimizer, DataLoader(data(), batch_size=BATCH))
    batches = open(out / f"batches-{WORKER}.jsonl", "a")  # appended to until the process ends
    steps = 0
    for _ in range(EPOCHS) if plain else accelerator.epochs(EPOCHS):
        for i, (index, x, y) in enumerate(train):
            if not plain:
                batches.write(json.dumps(micro_batch(accelerator, index)) + "\n")
                batches.flush()
            time.sleep(pause)
            if (i + 1) % WINDOW != 0:
                with accelerator.no_sync(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y) / WINDOW)
                if kill == f"{WORKER}:{getattr(accelerator, 'optimizer_steps', steps)}":
                    os.kill(os.getpid(), signal.SIGKILL)
            else:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y) / WINDOW)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "final.pt")
    steps = steps if plain else accelerator.optimizer_steps
    (out / f"record-{WORKER}.json").write_text(json.dumps({"steps": steps}))
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of each micro-batch")
    arguments = parser.parse_args()
    main(arguments.out, arguments.plain, arguments.kill, arguments.pause)
