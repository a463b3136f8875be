"""An ordinary user's Accelerate loop shaped like ``run_glue_no_trainer.py``, which may SIGKILL itself once while it
evaluates: after each epoch's training, a loop over a prepared evaluation DataLoader gathers every batch's sample ids,
predictions, references and per-sample losses with ``gather_for_metrics``; the main process appends what it gathered
in the epoch to ``OUT/eval.jsonl``. It knows nothing of lightning_elan's internals; only ``ElasticAccelerator`` and
``accelerator.epochs(n)``. float64 throughout.

python evaluate_and_die.py OUT [--die-evaluating EPOCH:BATCH:RANK] [--hold-for-joiners]

``--die-evaluating``: the process of that index SIGKILLs itself as it starts evaluation batch BATCH of epoch EPOCH
(once per job: ``OUT/died`` marks it). ``--hold-for-joiners`` (test scaffolding, a no-op outside `elan run`): the main
process holds before each training step until the new workers of every pending request are ready, so a replacement
joins at the next step whatever its start-up time. At the end the main process writes ``OUT/final.pt`` (the
parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator

TRAIN_SAMPLES, EVAL_SAMPLES, BATCH, EVAL_BATCH, EPOCHS = 96, 30, 6, 4, 3  # 30 = 4 global batches of 8, the last short


def dataset(samples: int, seed: int) -> TensorDataset:
    x = torch.randn(samples, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return TensorDataset(torch.arange(samples), x, (x.sum(dim=1) > 0).long())


def die_once(out: Path) -> None:
    marker = out / "died"
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def hold_for_joiners(accelerator: ElasticAccelerator, timeout_s: float = 120.0) -> None:
    """The main process: wait until every pending request has its new workers ready (test scaffolding)."""
    if not accelerator.is_main_process or "ELAN_AM_ADDRESS" not in os.environ:
        return
    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + timeout_s
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while time.monotonic() < deadline:
            pending = client.status()["pending"]
            if all(state == "ready" for request in pending for state in request["worker_status"].values()):
                return
            time.sleep(0.1)
    raise TimeoutError(f"the pending joiners are not ready after {timeout_s} s")


def evaluate(accelerator: ElasticAccelerator, model: nn.Module, loader: DataLoader, epoch: int,
             die: tuple[int, ...] | None, out: Path) -> dict[str, list]:
    model.eval()
    gathered: dict[str, list] = {"ids": [], "predictions": [], "references": [], "losses": []}
    for batch, (index, x, y) in enumerate(loader):
        if die == (epoch, batch, accelerator.process_index):
            die_once(out)
        with torch.no_grad():
            logits = model(x)
            losses = nn.functional.cross_entropy(logits, y, reduction="none")
        values = accelerator.gather_for_metrics((index, logits.argmax(dim=-1), y, losses))
        for key, value in zip(gathered, values, strict=True):
            gathered[key] += value.tolist()
    return gathered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-evaluating", type=lambda text: tuple(map(int, text.split(":"))), default=None)
    parser.add_argument("--hold-for-joiners", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    accelerator = ElasticAccelerator(cpu=True)
    set_seed(0)
    model = nn.Linear(5, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(dataset(TRAIN_SAMPLES, 0), batch_size=BATCH, shuffle=True)
    evaluation = DataLoader(dataset(EVAL_SAMPLES, 1), batch_size=EVAL_BATCH)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    for epoch in accelerator.epochs(EPOCHS):
        model.train()
        for _index, x, y in train:
            if args.hold_for_joiners:
                hold_for_joiners(accelerator)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        gathered = evaluate(accelerator, model, evaluation, epoch, args.die_evaluating, args.out)
        if accelerator.is_main_process:
            correct = sum(p == r for p, r in zip(gathered["predictions"], gathered["references"], strict=True))
            record = {"epoch": epoch, "processes": accelerator.num_processes,
                      "accuracy": correct / max(1, len(gathered["ids"])), **gathered}
            with (args.out / "eval.jsonl").open("a") as file:
                file.write(json.dumps(record) + "\n")
    accelerator.end_training()
    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save({key: value.detach().cpu() for key, value in state.items()}, args.out / "final.pt")


if __name__ == "__main__":
    main()
