"""One process of ``test_elastic_ddp.py``: ranks 0 and 1 train 3 steps as a pair, then rank 2 joins with a fresh
``ElasticDistributedDataParallel`` (its first iteration) and all three take 2 steps on a 3-process group; each prints
a JSON line with its gradient after every joint step. A plain DDP of the 3 processes gives the reference."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_elan.elastic.ddp import ElasticDistributedDataParallel


def group(store: dist.Store, prefix: str, rank: int, world: int) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    pg = dist.ProcessGroup(prefixed, rank, world)
    backend = dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=60))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=60))
    current: dict[str, dist.ProcessGroup | None] = {"group": group(store, "pair", rank, 2) if rank < 2 else None}
    elastic = ElasticDistributedDataParallel(model(), lambda: current["group"])
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3 if rank < 2 else 0):
        elastic.zero_grad()
        elastic(torch.randn(4, 8, generator=generator, dtype=torch.float64)).pow(2).mean().backward()
    # the joint steps: elastic on a 3-process group, and plain DDP on another (same inputs, same starting weights)
    current["group"] = group(store, "three", rank, 3)
    plain = DistributedDataParallel(model(), process_group=group(store, "plain", rank, 3))
    plain.module.load_state_dict(_everyone_from_rank0(elastic, current["group"]))
    for step in range(2):
        inputs = torch.randn(4, 8, generator=generator, dtype=torch.float64)
        grads = {}
        for name, ddp in (("elastic", elastic), ("plain", plain)):
            ddp.zero_grad()
            ddp(inputs).pow(2).mean().backward()
            grads[name] = torch.cat([p.grad.flatten() for p in ddp.module.parameters()]).tolist()
        print(json.dumps({"rank": rank, "step": step, **grads}), flush=True)
    # torch 2.13: freeing plain DDP's Reducer (here, when main's locals go) drops the last reference to its gloo group,
    # whose destructor joins the group's worker thread while holding the GIL that the thread needs to free a finished
    # all-reduce — one exit in a few hangs (seen with py-spy, and in CI after the same exit was moved below main()).
    # Everything is printed and flushed; leave without running destructors, before any local is released.
    os._exit(0)


def _everyone_from_rank0(ddp: ElasticDistributedDataParallel, pg: dist.ProcessGroup) -> dict:
    """Rank 0's parameters and buffers on every process (what a replication gives a joiner)."""
    state = ddp.module.state_dict()
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    for tensor in state.values():
        pg.broadcast([tensor], options).wait()
    ddp.module.load_state_dict(state)
    return state


if __name__ == "__main__":
    main()
