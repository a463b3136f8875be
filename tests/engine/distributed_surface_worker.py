"""One process of the torch.distributed-surface test: ``python distributed_surface_worker.py INDEX STORE_PORT OUT``.

The processes go through the generations of ``process_group_worker.GENERATIONS`` (0 and 1; then all three; then 2 and
0, after an abort) on one elastic default group. In every generation each member calls what user code, Lightning,
torchmetrics and Accelerate call — ``new_group`` in all its forms, Lightning's own ``_InfiniteBarrier``, the object
collectives, point-to-point, ``init_device_mesh`` — and records what it saw. A group made in one generation is used
again in the next: it must raise an error naming the resize, never hang.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _InfiniteBarrier

from lightning_elan.elastic.process_group import ElasticProcessGroup, install_default_group
from tests.engine.process_group_worker import GENERATIONS


def summed(group: Any = None, value: float = 1.0) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=group)
    return tensor.item()


def groups(rank: int, world: int) -> dict[str, Any]:
    whole = dist.new_group()
    gloo = dist.new_group(backend="gloo", timeout=timedelta(days=10000))  # Lightning's _InfiniteBarrier
    first_two = dist.new_group(ranks=[0, 1])
    local = dist.new_group(ranks=[0, world - 1], use_local_synchronization=True) if rank in (0, world - 1) else None
    mine, _ = dist.new_subgroups(group_size=1)
    seen = {"whole": summed(whole, rank + 1), "gloo": summed(gloo), "mine": summed(mine, rank + 10),
            "first_two": summed(first_two) if rank < 2 else dist.get_rank(first_two),
            "local": summed(local) if local is not None else None,
            "whole_rank": dist.get_rank(whole), "whole_size": dist.get_world_size(whole)}
    dist.monitored_barrier(gloo, timeout=timedelta(seconds=30))
    gloo.monitored_barrier()  # as _InfiniteBarrier calls it
    for group in (whole, gloo, first_two, local, mine):
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    return seen


def objects(rank: int, world: int) -> dict[str, Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=world - 1)
    at_zero: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), at_zero, dst=0)
    scattered: list[Any] = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0)
    return {"all_gather_object": [g["rank"] for g in gathered], "broadcast_object_list": box[0],
            "gather_object": [list(g) for g in at_zero] if at_zero is not None else None, "scatter": scattered[0]}


def point_to_point(rank: int, world: int) -> float:
    """A ring: each rank sends its rank to the next and receives the previous one's."""
    out, got = torch.tensor([float(rank)]), torch.zeros(1)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(out, nxt)
        dist.recv(got, prev)
    else:
        dist.recv(got, prev)
        dist.send(out, nxt)
    return got.item()


def mesh_sum(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return summed(mesh.get_group(), rank + 1)


def infinite_barrier() -> bool:
    with _InfiniteBarrier():
        pass
    return True


def observe(rank: int, world: int) -> dict[str, Any]:
    dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "groups": groups(rank, world), "objects": objects(rank, world), "p2p": point_to_point(rank, world),
            "mesh": mesh_sum(rank, world), "infinite_barrier": infinite_barrier()}


def stale_use(group: Any) -> str:
    """What using a group made in an earlier generation does (it must raise, naming the resize)."""
    try:
        summed(group)
    except RuntimeError as error:
        return str(error)
    return "no error"


def main(index: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    group = ElasticProcessGroup(store, "gloo", timedelta(seconds=60), torch.device("cpu"))
    seen: dict[int, dict] = {}
    kept = None
    for generation, ranks in GENERATIONS.items():
        if index not in ranks:
            group.shutdown()
            continue
        if generation == 2:
            group.abort()  # as after a failure: the next configure must still work
        group.configure(f"pg/gen{generation}/", ranks[index], len(ranks))
        install_default_group(group)
        seen[generation] = observe(ranks[index], len(ranks))
        if kept is not None:
            seen[generation]["stale"] = stale_use(kept)
        kept = dist.new_group()
        dist.barrier()
    with open(out, "w") as file:
        json.dump(seen, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
