"""One rank of ``test_fsdp2_remesh.py``: a float64 MLP trained with FSDP2 (``fully_shard``) on the ranks ``OLD``,
then sharded again, in place, on the ranks ``NEW`` and trained on (``replication.fsdp_reshard.reshard_fsdp``): each
rank of ``NEW`` receives only the rows of its new shard (parameters and Adam's moments) from the ranks that held them,
point to point over gloo; a rank that joins builds the module and its optimizer on the meta device (no full copy) and
the optimizer object it made trains on. What ``elan_fsdp`` (issue 24) will stand on.

    python fsdp2_remesh_worker.py RANK PORT OLD NEW OUT     (OLD, NEW: comma-separated ranks of a world of 3)
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_elan.replication.fsdp_reshard import reshard_fsdp

WORLD, GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER, LR = 3, 12, 2, 2, 0.01


def new_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5), nn.ReLU(), nn.Linear(5, 3)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 7, dtype=torch.float64, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g,
                                                                                       dtype=torch.float64)


def reference() -> dict[str, torch.Tensor]:
    """One process, the whole model, the same global batches."""
    model, (x, y) = new_model(), data()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(STEPS_BEFORE + STEPS_AFTER):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def shard(model: nn.Sequential, mesh: DeviceMesh) -> None:
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: list[int], steps: int) -> None:
    x, y = data()
    share = GLOBAL_BATCH // len(ranks)
    mine = slice(ranks.index(dist.get_rank()) * share, (ranks.index(dist.get_rank()) + 1) * share)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()  # FSDP2 averages the gradients over the mesh
        optimizer.step()


def main() -> None:
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[5]
    old, new = ([int(r) for r in ranks.split(",")] for ranks in sys.argv[3:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    old_group, new_group = dist.new_group(old), dist.new_group(new)
    if rank in old:
        model = new_model()
        shard(model, DeviceMesh.from_group(old_group, "cpu"))
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        train(model, optimizer, old, STEPS_BEFORE)
    else:
        with torch.device("meta"):
            model = new_model()  # a joiner: no full copy, only the rows of its shard arrive
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    mesh = DeviceMesh.from_group(new_group, "cpu") if rank in new else None
    reshard_fsdp(model, [optimizer], shard, old, new, mesh)
    if rank in new:
        train(model, optimizer, new, STEPS_AFTER)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        expected = reference()
        error = max((full[name] - expected[name]).abs().max().item() for name in full)
        local_rows = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
        steps = sorted({float(state["step"]) for state in optimizer.state.values()})
        with open(out, "w") as f:
            json.dump({"error": error, "rows": local_rows, "steps": steps}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
