"""One process of the elastic DDP reset test: ``python ddp_reset_worker.py INDEX STORE_PORT OUT_JSON``.

For each scenario (``SCENARIOS``, with and without ``gradient_as_bucket_view``) the three processes form a generation
and start an iteration; processes 0 and 1, the survivors, learn at a chosen phase that the generation failed
(``ElasticProcessGroup.fail``, what the failure watch does when a member died) while process 2, the dead member, takes
no further part in it. The survivors discard the iteration (``ElasticDistributedDataParallel.discard_iteration``),
abort the generation, form the next one between the two of them, and train two more iterations; each must give the
gradients a fresh elastic DDP of the same model gives on the same batches, bit for bit.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.elastic.ddp import ElasticDistributedDataParallel
from lightning_elan.elastic.failures import PeerFailure
from lightning_elan.elastic.process_group import ElasticProcessGroup, install_default_group

SCENARIOS = ("forward", "backward", "allreduce", "no_sync", "complete")
"""Where the failure reaches the survivors: after the forward (the first bucket's hook finds the generation failed and
raises), mid-backward (some parameters marked ready, then the same), inside the all-reduce (every bucket launched, the
dead never sends: the pending all-reduces fail), in the synchronising micro-batch after one under ``no_sync``, or after
a complete iteration (nothing to discard)."""
DEAD = 2
BUCKET_CAP_MB = 0.004  # a few buckets: a backward can fail between two of them


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1)).double()


def batch(index: int, iteration: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * iteration + index)
    return torch.randn(4, 8, generator=generator, dtype=torch.float64)


class Job:
    """This process's group and the view of the current generation its elastic DDPs all-reduce on."""

    def __init__(self, index: int, store: dist.Store) -> None:
        self.index = index
        self.group = ElasticProcessGroup(store, "gloo", timedelta(seconds=30), torch.device("cpu"))
        self.view: dist.ProcessGroup | None = None
        self.prefix = ""

    def form(self, prefix: str, rank: int, world_size: int) -> None:
        self.group.configure(prefix, rank, world_size)
        self.view, self.prefix = self.group.generation_view(), prefix
        install_default_group(self.group)  # as the engine does: at exit, abandoned generations are disarmed

    def fail(self) -> None:
        self.group.fail(self.prefix, PeerFailure(0, "simulated"))

    def fail_once(self) -> Callable[[torch.Tensor], None]:
        """A gradient hook that fails the generation the first time only (it stays registered on the parameter)."""
        fired: list[bool] = []

        def hook(grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                self.fail()

        return hook

    def ddp(self, model: torch.nn.Module, as_view: bool) -> ElasticDistributedDataParallel:
        return ElasticDistributedDataParallel(model, lambda: self.view, bucket_cap_mb=BUCKET_CAP_MB,
                                              gradient_as_bucket_view=as_view)


def interrupted_iteration(job: Job, ddp: ElasticDistributedDataParallel, scenario: str) -> str | None:
    """The survivors' iteration of the failed generation; returns the error it ended with (None: it completed)."""
    x = batch(job.index, 0)
    if scenario == "no_sync":
        with ddp.no_sync():
            ddp(x).sum().backward()
    loss = ddp(x).sum()
    timer = None
    if scenario in ("forward", "no_sync"):
        job.fail()
    elif scenario == "backward":
        ddp.module[0].weight.register_hook(job.fail_once())  # the first layer's gradient comes last
    elif scenario == "allreduce":
        timer = threading.Timer(0.3, job.fail)  # the survivors wait in the all-reduce for the dead
        timer.start()
    try:
        loss.backward()
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:200]
    finally:
        if timer is not None:
            timer.join()
    return None


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.grad.clone() for parameter in model.parameters()]


def redo(job: Job, ddp: ElasticDistributedDataParallel, as_view: bool) -> dict[str, Any]:
    """Two iterations after the discard, each against a fresh elastic DDP of the same parameters and batch."""
    equal = []
    for iteration in (1, 2):
        fresh_model = make_model()
        fresh_model.load_state_dict(ddp.module.state_dict())
        fresh = job.ddp(fresh_model, as_view)
        x = batch(job.index, iteration)
        ddp.module.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        fresh(x).sum().backward()
        equal.append(all(torch.equal(a, b) for a, b in zip(gradients(ddp.module), gradients(fresh_model),
                                                              strict=True)))
    return {"equal": equal, "buckets": len(ddp.reducer._get_zeros_like_grad_buckets())}


def scenario(job: Job, store: dist.Store, name: str, number: int, as_view: bool) -> dict[str, Any] | None:
    job.form(f"reset/{number}/gen0/", job.index, 3)
    model = make_model()
    ddp = job.ddp(model, as_view)
    if job.index == DEAD:
        if name == "complete":
            ddp(batch(job.index, 0)).sum().backward()
        job.group.abort()  # and goes on to the next scenario's generation
        return None
    error = interrupted_iteration(job, ddp, name)
    ddp.discard_iteration()
    result = {"error": error, "sync": ddp.require_backward_grad_sync,
              "grads_cleared": all(p.grad is None for p in model.parameters())}
    job.group.abort()
    job.form(f"reset/{number}/gen1/", job.index, 2)
    result.update(redo(job, ddp, as_view))
    return result


def main(index: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = Job(index, store)
    results = {}
    number = 0
    for as_view in (False, True):
        for name in SCENARIOS:
            result = scenario(job, store, name, number, as_view)
            if result is not None:
                results[f"{name}/view={as_view}"] = result
            number += 1
    if index == DEAD:  # alive until the survivors are done: they never see its sockets close
        store.wait(["reset/over"])
    elif index == 0:
        store.set("reset/over", "1")
    with open(out, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
