"""An Accelerate loop in the shape of Accelerate's examples, with code at each epoch's end (``python
accelerate_epoch_end_loop.py OUT [--die-at POINT:RANK:EPOCH]``, launched by ``test_accelerate_epoch_end.py`` through
`elan run`): ``accumulate()`` of 2 micro-batches with ``clip_grad_norm_``, a per-epoch ``StepLR``, and after the loop
over the batches ``accelerator.reduce`` of the epoch's summed loss, an evaluation pass (``gather_for_metrics``), the
epoch's row logged to a custom tracker (Accelerate's "Implementing Custom Trackers": ``OUT/logs/run.jsonl``) and
``save_state()`` with ``automatic_checkpoint_naming``; ``unwrap_model`` + ``accelerator.save`` on the main process at
the end (``OUT/final.pt``).

``--die-at reduce:2:1``: the process of rank 2 SIGKILLs itself in epoch 1 just before its ``reduce``. ``--hold``:
under `elan run`, the main process holds before each batch until the joiners due at the next step are ready (so a
scheduled ``add`` lands at its step). Each process appends the samples of every batch it trains to
``OUT/samples-<pid>.jsonl`` with the step and the world size.
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
from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, EPOCHS = 192, 4


class JsonTracker(GeneralTracker):
    name = "json"
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
        with self.path.open("a") as log:
            log.write(json.dumps({"config": values}) + "\n")

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        with self.path.open("a") as log:
            log.write(json.dumps({"step": step, **values}) + "\n")


class Rows(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 6, generator=generator, dtype=torch.float64)
        self.y = self.x[:, :2].sum(1, keepdim=True).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def die_here(accelerator: ElasticAccelerator, out: Path, die_at: str | None, point: str, epoch: int) -> None:
    if die_at is None:
        return
    where, rank, at_epoch = die_at.split(":")
    marker = out / f"died-{where}"
    if (where, int(rank), int(at_epoch)) == (point, accelerator.process_index, epoch) and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def hold_for_joiners(accelerator: ElasticAccelerator, timeout_s: float = 240.0) -> None:
    """The main process: wait until every request due at the next step has its new workers ready."""
    if not accelerator.is_main_process or "ELAN_AM_ADDRESS" not in os.environ:
        return
    from lightning_elan.protocol.client import AMClient

    step, deadline = accelerator.optimizer_steps + 1, time.monotonic() + timeout_s
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while time.monotonic() < deadline:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            time.sleep(0.1)
    raise TimeoutError(f"the joiners due at step {step} are not ready after {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-at", default=None)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    set_seed(11)
    accelerator = ElasticAccelerator(gradient_accumulation_steps=2, log_with=[JsonTracker("run", args.out / "logs")],
                                     project_config=ProjectConfiguration(project_dir=str(args.out),
                                                                         automatic_checkpoint_naming=True))
    accelerator.init_trackers("run", config={"lr": 0.05, "epochs": EPOCHS})
    model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.GELU(), torch.nn.Linear(24, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    train = DataLoader(Rows(SAMPLES), batch_size=4, shuffle=True)
    val = DataLoader(Rows(40), batch_size=5)
    model, optimizer, train, val, scheduler = accelerator.prepare(model, optimizer, train, val, scheduler)
    samples = args.out / f"samples-{os.getpid()}.jsonl"
    for epoch in accelerator.epochs(EPOCHS):
        model.train()
        total = torch.zeros((), dtype=torch.float64)
        for indices, x, y in train:
            if args.hold:
                hold_for_joiners(accelerator)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
            with samples.open("a") as record:
                record.write(json.dumps({"epoch": epoch, "step": accelerator.optimizer_steps,
                                         "world": accelerator.num_processes, "samples": indices.tolist()}) + "\n")
        scheduler.step()
        die_here(accelerator, args.out, args.die_at, "reduce", epoch)
        epoch_loss = accelerator.reduce(total, reduction="sum")
        model.eval()
        errors = []
        for _, x, y in val:
            with torch.no_grad():
                errors.append(accelerator.gather_for_metrics((model(x) - y).pow(2)))
        accelerator.log({"epoch": epoch, "epoch_loss_sum": epoch_loss.item(),
                         "val_mse": torch.cat(errors).mean().item()}, step=accelerator.optimizer_steps)
        accelerator.save_state()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        accelerator.save({key: value.clone() for key, value in state.items()}, args.out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
