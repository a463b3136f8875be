"""An Accelerate loop whose application master stops answering for a moment (``python accelerate_slow_am_loop.py OUT
[SLOW_AT]``, launched by ``test_slow_am_coordinate.py`` through `elan run`).

A plain float64 regression loop: 64 samples, 4 per process (8 global batches per epoch at 2 workers), 3 epochs inside
``accelerator.epochs``. Rank 0 holds before each step until the workers of the scale requests due then are ready, so
the AM decides each request at its scheduled step. With ``SLOW_AT`` (a step), rank 0 SIGSTOPs the job's AM process
before that step (the joiners due are ready) and a timer SIGCONTs it 2.5 s later: the step's ``coordinate`` reaches an
AM that answers late, as a loaded host's AM does, and the AM decides the plan after rank 0 stopped waiting.

Each worker writes ``OUT/record-<worker>.json`` (the samples it trained per epoch, whether it left) and
``OUT/final-<worker>.pt`` (its final parameters).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS = 64, 4, 3
AM_SILENT_S = 2.5


class Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
        self.y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def hold_for_joiners(accelerator: ElasticAccelerator, timeout_s: float = 240.0) -> None:
    """Rank 0: wait until every request due at the next step has its new workers ready."""
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


def am_pid(job: str) -> int:
    """The pid of the job's AM process (``python -m lightning_elan.cli am --job JOB ...``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lightning_elan.cli" in argv and b"am" in argv and job.encode() in argv:
            return int(entry.name)
    raise LookupError(f"no AM process of job {job!r}")


def silence_the_am(seconds: float) -> None:
    """SIGSTOP the job's AM now and SIGCONT it ``seconds`` later (a timer thread)."""
    pid = am_pid(os.environ["ELAN_JOB"])
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()


def main(out: Path, slow_at: int | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = DataLoader(Indexed(), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    worker = os.environ.get("ELAN_WORKER_ID", "alone")
    trained: dict[int, list[int]] = {}
    for epoch in accelerator.epochs(EPOCHS):
        for index, x, y in data:
            hold_for_joiners(accelerator)
            if accelerator.is_main_process and accelerator.optimizer_steps + 1 == slow_at:
                silence_the_am(AM_SILENT_S)
            if accelerator.sample_weight > 0:
                trained.setdefault(epoch, []).extend(index.tolist())
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.1)
    record = {"worker": worker, "left": accelerator.has_left, "trained": trained,
              "optimizer_steps": accelerator.optimizer_steps}
    (out / f"record-{worker}.json").write_text(json.dumps(record))
    if not accelerator.has_left:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save({name: value.detach().clone() for name, value in state.items()}, out / f"final-{worker}.pt")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
