"""An Accelerate loop logging to an experiment tracker the way Accelerate's docs show it ("Implementing Custom
Trackers": a ``GeneralTracker`` appending JSON lines, ``init_trackers`` with the run's config, ``accelerator.log`` of
every applied step's loss and of each epoch's evaluation), run by ``test_accelerate_tracker_rows.py`` through
`elan run` (``python accelerate_tracker_rows_loop.py OUT [--die-at POINT:RANK:WHEN]``).

Float64 regression, 96 samples, 4 per process, 3 epochs; after each epoch an evaluation pass (``gather_for_metrics``)
and its row. ``--die-at epoch_log:0:1``: the main process SIGKILLs itself just before its ``accelerator.log`` of epoch
1's evaluation row; ``--die-at step_log:0:9``: just before its row of step 9 (the step is applied everywhere). The
tracker writes ``OUT/logs/run.jsonl`` (each line with the writing pid); each process appends the samples of every
step it applied to ``OUT/samples-<pid>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, EPOCHS = 96, 3


class JsonLinesTracker(GeneralTracker):
    name = "jsonl"
    requires_logging_directory = True

    @on_main_process
    def __init__(self, run_name: str, logging_dir: str | Path) -> None:
        super().__init__()
        self.path = Path(logging_dir) / f"{run_name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def tracker(self) -> Any:
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self._write({"config": values})

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, **values})

    def _write(self, line: dict) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"pid": os.getpid(), **line}) + "\n")


class Rows(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 5, generator=generator, dtype=torch.float64)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def die_here(accelerator: ElasticAccelerator, out: Path, die_at: str | None, point: str, when: int) -> None:
    if die_at is None:
        return
    where, rank, at = die_at.split(":")
    marker = out / f"died-{where}"
    if (where, int(rank), int(at)) == (point, accelerator.process_index, when) and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-at", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    set_seed(5)
    accelerator = ElasticAccelerator(log_with=[JsonLinesTracker("run", args.out / "logs")])
    accelerator.init_trackers("run", config={"lr": 0.05, "epochs": EPOCHS})
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train = DataLoader(Rows(SAMPLES, 1), batch_size=4, shuffle=True)
    val = DataLoader(Rows(30, 2), batch_size=5)
    model, optimizer, train, val = accelerator.prepare(model, optimizer, train, val)
    samples = args.out / f"samples-{os.getpid()}.jsonl"
    for epoch in accelerator.epochs(EPOCHS):
        model.train()
        for indices, x, y in train:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.optimizer_step_was_skipped:  # a member died: the step is trained again
                continue
            with samples.open("a") as record:
                record.write(json.dumps({"epoch": epoch, "step": accelerator.optimizer_steps,
                                         "samples": indices.tolist()}) + "\n")
            die_here(accelerator, args.out, args.die_at, "step_log", accelerator.optimizer_steps)
            accelerator.log({"train_loss": loss.item()}, step=accelerator.optimizer_steps)
        model.eval()
        errors = []
        for _, x, y in val:
            with torch.no_grad():
                errors.append(accelerator.gather_for_metrics((model(x) - y).pow(2)))
        val_mse = torch.cat(errors).mean().item()
        die_here(accelerator, args.out, args.die_at, "epoch_log", epoch)
        accelerator.log({"epoch": epoch, "val_mse": val_mse}, step=accelerator.optimizer_steps)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        accelerator.save({key: value.clone() for key, value in state.items()}, args.out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
