"""One process of the trainable-parameters test: ``python ddp_trainable_worker.py INDEX STORE_PORT OUT_JSON``.

Two processes form a generation and train an elastic DDP whose first layer is frozen; after two steps they unfreeze
it (as Lightning's ``BackboneFinetuning`` does at its epoch) and train three more, the third of them accumulating two
micro-batches (the first under ``no_sync``), then freeze it again for one more step. Each process also trains a
plain copy of the model on both processes' batches (the mean of the two processes' losses: DDP's arithmetic) and
writes the largest difference from it and its parameters, with and without ``gradient_as_bucket_view``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elan.elastic.ddp import ElasticDistributedDataParallel
from lightning_elan.elastic.process_group import ElasticProcessGroup, install_default_group

WORLD = 2
PLAN = ("frozen", "frozen", "unfrozen", "unfrozen", "accumulate", "refrozen")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return torch.nn.functional.mse_loss(model(x), y)


def set_backbone(model: torch.nn.Module, trainable: bool) -> None:
    model[0].requires_grad_(trainable)


def train(rank: int, view: dist.ProcessGroup, as_view: bool) -> dict:
    model, reference = make_model(), make_model()
    set_backbone(model, False)
    set_backbone(reference, False)
    ddp = ElasticDistributedDataParallel(model, lambda: view, bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    rebuilt = []
    for step, phase in enumerate(PLAN):
        set_backbone(model, phase in ("unfrozen", "accumulate"))
        set_backbone(reference, phase in ("unfrozen", "accumulate"))
        micros = 2 if phase == "accumulate" else 1
        for micro in range(micros):
            rebuilt.append(ddp.follow_trainable_parameters())
            if micro < micros - 1:
                with ddp.no_sync():
                    (loss_of(ddp, batch(rank, step, micro)) / micros).backward()
            else:
                (loss_of(ddp, batch(rank, step, micro)) / micros).backward()
            mean = sum(loss_of(reference, batch(other, step, micro)) for other in range(WORLD)) / WORLD
            (mean / micros).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    difference = max((a - b).abs().max().item() for a, b in pairs)
    return {"difference": difference, "rebuilt": rebuilt,
            "parameters": [parameter.detach().flatten().tolist() for parameter in model.parameters()]}


def main() -> None:
    index, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=timedelta(seconds=60))
    group = ElasticProcessGroup(store, "gloo", timedelta(seconds=30), torch.device("cpu"))
    group.configure("trainable/", index, WORLD)
    install_default_group(group)
    view = group.generation_view()
    results = {f"view={as_view}": train(index, view, as_view) for as_view in (False, True)}
    with open(out, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
