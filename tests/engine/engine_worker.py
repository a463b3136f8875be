"""A worker process for the engine tests: a plain torch training loop (no Lightning) as the engine's front-end.

Run as ``python engine_worker.py OUT_JSON`` with the launcher's ``ELAN_*`` variables set. It trains a float64 linear
model on 48 fixed samples with a global batch of 12, all-reducing gradients on the engine's group, and writes what it
consumed, a digest per step and its final parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lightning_elan.elastic import ElasticWorker, NotAMember
from lightning_elan.protocol.contract import WorkerEnvironment
from lightning_elan.replication.reception import destinations_by_name, tensor_nbytes

SAMPLES, GLOBAL_BATCH, STEPS, STEP_SLEEP_S = 48, 12, 40, 0.12


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 5, generator=generator, dtype=torch.float64)
    return x, x @ torch.linspace(-1, 1, 5, dtype=torch.float64) + 0.5


def new_model() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def epoch_order(epoch: int) -> list[int]:
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


class Left(Exception):
    """This worker left the job."""


class TorchLoop:
    """The front-end: what only this training loop knows."""

    def __init__(self, engine: ElasticWorker) -> None:
        self.engine = engine
        self.model, self.optimizer = new_model()
        self.step = 0
        self.resizes: list[tuple[int | None, int, int]] = []

    def training_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def receive_destinations(self, state: dict[str, Any]) -> dict[int, torch.Tensor]:
        return destinations_by_name(state["model"], self.model.state_dict(keep_vars=True))

    def state_nbytes_beyond_model(self) -> int:
        return tensor_nbytes(self.optimizer.state)

    def state_nbytes(self) -> int:
        return tensor_nbytes(self.model.state_dict()) + self.state_nbytes_beyond_model()

    def epoch_aggregates(self) -> dict[str, Any] | None:
        return None  # a plain loop: nothing reduced at an epoch's end

    def absorb_epoch_aggregates(self, parts: list[dict[str, Any]]) -> None:
        raise AssertionError("never called: no aggregates are recorded")

    def shared_state(self) -> dict[str, Any]:
        return {}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        pass

    def adjustment_blocker(self) -> str | None:
        return None

    def before_resize(self) -> None:
        pass

    def membership_changed(self, previous_rank: int | None) -> None:
        self.resizes.append((previous_rank, self.engine.rank, self.engine.world_size))

    def after_resize(self) -> None:
        pass

    def leave(self) -> NoReturn:
        raise Left


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    hasher = hashlib.sha256()
    for parameter in model.parameters():
        hasher.update(parameter.detach().numpy().tobytes())
        hasher.update(optimizer.state[parameter]["momentum_buffer"].numpy().tobytes())
    return hasher.hexdigest()


def train_one_step(loop: TorchLoop, x: torch.Tensor, y: torch.Tensor, consumed: dict[int, list[int]]) -> None:
    engine = loop.engine
    if engine.data.position >= SAMPLES:
        engine.data.start_epoch(engine.data.epoch + 1)
    epoch = engine.data.epoch
    share = engine.take_global_batch(SAMPLES)
    indices = epoch_order(epoch)[share.start : share.stop] or [0]  # a rank without samples trains with weight 0
    if share.size:
        consumed.setdefault(epoch, []).extend(indices)
    loss = torch.nn.functional.mse_loss(loop.model(x[indices]).squeeze(1), y[indices]) * share.loss_weight
    loop.optimizer.zero_grad()
    loss.backward()
    for parameter in loop.model.parameters():
        dist.all_reduce(parameter.grad)  # the engine's group is torch's default group
        parameter.grad /= engine.world_size
    loop.optimizer.step()
    loop.step += 1


def main(out_path: str) -> None:
    logging.basicConfig(level=os.environ.get("ENGINE_WORKER_LOG", "WARNING"), format="%(name)s: %(message)s")
    environment = WorkerEnvironment.from_env()
    engine = ElasticWorker(environment, coordinate_every=1, global_batch=GLOBAL_BATCH)
    loop = TorchLoop(engine)
    engine.attach(loop)
    engine.start("gloo", torch.device("cpu"), timedelta(seconds=60))
    x, y = dataset()
    consumed: dict[int, list[int]] = {}
    digests: list[tuple[int, str]] = []
    outcome = "finished"
    try:
        if not engine.is_member:
            engine.join()
        while loop.step < STEPS:
            train_one_step(loop, x, y, consumed)
            digests.append((loop.step, digest(loop.model, loop.optimizer)))
            time.sleep(STEP_SLEEP_S)
            engine.at_batch_boundary(loop.step)
    except Left:
        outcome = "left"
    except NotAMember:
        outcome = "not needed"
    engine.close()
    result = {
        "worker": environment.worker_id, "outcome": outcome, "consumed": consumed, "digests": digests,
        "resizes": loop.resizes, "params": [p.detach().flatten().tolist() for p in loop.model.parameters()],
    }
    with open(out_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
