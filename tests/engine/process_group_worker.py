"""One process of the ElasticProcessGroup test: ``python process_group_worker.py INDEX STORE_PORT OUT_JSON``.

Processes 0 and 1 form generation 0; all three form generation 1 (process 2 joins); process 1 leaves, and processes 2
and 0 form generation 2 (process 2 as rank 0) after aborting generation 1. At each generation a process records what
torch.distributed reports through the default group and what DDP computes on the generation's own group.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elan.elastic.process_group import ElasticProcessGroup, install_default_group

# generation -> {process index: rank}
GENERATIONS = {0: {0: 0, 1: 1}, 1: {0: 0, 1: 1, 2: 2}, 2: {2: 0, 0: 1}}


def ddp_gradient(group: ElasticProcessGroup, rank: int) -> float:
    """DDP on the generation's own group: the mean over ranks of the local gradient 4·(rank + 1)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group.current, init_sync=False)
    ddp(torch.ones(4, 3, dtype=torch.float64) * (rank + 1)).sum().backward()
    return model.weight.grad[0, 0].item()


def observe(group: ElasticProcessGroup, rank: int) -> dict:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    box = [f"from rank {rank}"]
    dist.broadcast_object_list(box, src=0)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "sum": total.item(), "object": box[0], "gathered": [t.item() for t in gathered],
            "ddp_grad": ddp_gradient(group, rank), "default_is_group": dist.group.WORLD is group}


def main(index: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    group = ElasticProcessGroup(store, "gloo", timedelta(seconds=60), torch.device("cpu"))
    seen: dict[int, dict] = {}
    for generation, ranks in GENERATIONS.items():
        if index not in ranks:
            group.shutdown()
            continue
        if generation == 2:
            group.abort()  # as after a failure: the next configure must still work
        group.configure(f"pg/gen{generation}/", ranks[index], len(ranks))
        install_default_group(group)
        seen[generation] = observe(group, ranks[index])
    with open(out, "w") as file:
        json.dump(seen, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
