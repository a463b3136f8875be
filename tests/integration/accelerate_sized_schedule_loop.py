"""An Accelerate loop that sizes its LR schedule as transformers' ``run_glue_no_trainer.py`` does (``python
accelerate_sized_schedule_loop.py OUT``, launched by ``test_accelerate_sized_schedule.py``): ``get_scheduler("linear")``
built before ``prepare()`` with its warm-up and total steps times ``accelerator.num_processes`` (the prepared scheduler
steps once per process and optimizer step). A float64 MLP, AdamW, 96 samples, ``DataLoader(batch_size=4)``, 3 epochs.

Every worker writes ``OUT/record-<worker>.json`` (its ``num_processes`` before ``prepare()``, the samples trained per
epoch, the LR of each step it trained); the main process writes ``OUT/final.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import get_scheduler

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS = 96, 4, 3


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"idx": index, "x": self.x[index], "y": self.y[index]}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train = DataLoader(Points(SAMPLES, 1), batch_size=BATCH, shuffle=True)
    max_train_steps = EPOCHS * len(train)
    processes = accelerator.num_processes
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=2 * processes,
                              num_training_steps=max_train_steps * processes)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)
    record: dict = {"processes_before_prepare": processes, "trained": {}, "lrs": []}
    for epoch in accelerator.epochs(EPOCHS):
        for batch in train:
            accelerator.backward(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if not accelerator.optimizer_step_was_skipped:
                record["trained"].setdefault(epoch, []).extend(batch["idx"].tolist())
                record["lrs"].append(lr)
    worker = os.environ.get("ELAN_WORKER_ID", "w0")
    record.update(worker=worker, left=accelerator.has_left)
    (out / f"record-{worker}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
