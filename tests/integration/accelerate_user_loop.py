"""A small Accelerate loop written the ways users write them (``python accelerate_user_loop.py WAYS OUT``, WAYS a comma
list, launched by ``test_accelerate_user_loops.py`` through `elan run`):

* ``register_after``: ``register_for_checkpointing`` after ``prepare()``;
* ``autoname``: ``save_state()`` after every epoch with ``automatic_checkpoint_naming``;
* ``skip``: ``skip_first_batches(train, 2)`` in the first epoch (the resume idiom of ``run_clm_no_trainer.py``);
* ``range``: ``for epoch in range(3)`` instead of ``accelerator.epochs(3)``;
* ``counter``: ``run_*_no_trainer.py``'s local step counter, both loops left at ``MAX_STEPS`` with ``break``;
* ``gather``: ``accelerator.gather`` of each batch's sample indices (a statistic over the global batch), whose
  shares are uneven at 3 workers (8 samples: 3, 3, 2);
* ``plain``: none of these.

After its loop each worker waits for the others (``wait_for_everyone``). Under `elan run`, rank 0 holds before each
step until the workers of the scale requests due then are ready, so each adjustment lands at its scheduled step.

Each worker writes ``OUT/record-<worker>.json``: the registered counter, the optimizer steps, the samples it trained
per epoch (as global batch indices), whether it left, and what ``is_main_process``/``is_local_main_process`` said after
its loop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS = 64, 4, 3  # 8 global batches per epoch at 2 workers
MAX_STEPS = 20  # ``counter``: the job's last step (of 24)


class Counter:
    """What a user registers for checkpointing: the batches trained by the job."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)

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


def main(ways: set[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    autoname = "autoname" in ways
    accelerator = ElasticAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(out), automatic_checkpoint_naming=autoname))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(Indexed(), batch_size=BATCH)
    counter = Counter()
    if "register_after" not in ways:
        accelerator.register_for_checkpointing(counter)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    if "register_after" in ways:
        accelerator.register_for_checkpointing(counter)
    worker = os.environ.get("ELAN_WORKER_ID", "alone")
    trained: dict[int, list[int]] = {}
    gathered: dict[int, list[list[int]]] = {}
    completed_steps = 0
    for epoch in range(EPOCHS) if "range" in ways else accelerator.epochs(EPOCHS):
        loader = accelerator.skip_first_batches(data, 2) if "skip" in ways and epoch == 0 else data
        for index, x, y in loader:
            hold_for_joiners(accelerator)
            if accelerator.sample_weight > 0:
                trained.setdefault(epoch, []).extend(index.tolist())
            if "gather" in ways:
                gathered.setdefault(epoch, []).append(sorted(set(accelerator.gather(index).tolist())))
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            counter.n += 1
            completed_steps += 1
            time.sleep(0.2)
            if "counter" in ways and completed_steps >= MAX_STEPS:
                break
        if "counter" in ways and completed_steps >= MAX_STEPS:
            break
        if autoname:
            accelerator.save_state()
    record = {"worker": worker, "counter": counter.n, "optimizer_steps": accelerator.optimizer_steps,
              "left": accelerator.has_left, "main": accelerator.is_main_process,
              "local_main": accelerator.is_local_main_process, "trained": trained, "gathered": gathered}
    (out / f"record-{worker}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(set(sys.argv[1].split(",")), Path(sys.argv[2]))
