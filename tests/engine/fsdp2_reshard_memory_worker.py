"""One rank of ``test_fsdp2_reshard_memory.py``: a float32 MLP whose full state (parameters and Adam's two moments,
``FULL_BYTES``, about 200 MB) is far above the reshard's chunk, trained one step with FSDP2 on the ranks ``OLD``, then
sharded again on the ranks ``NEW`` (``replication.fsdp_reshard.reshard_fsdp``, ``chunk_bytes`` = ``CHUNK_MB``). Each
rank measures its peak resident-set growth over the reshard alone (the peak reset through ``/proc/self/clear_refs``
right before, ``VmHWM`` after, against ``VmRSS`` before) and writes it with the bytes of its new shard.

    python fsdp2_reshard_memory_worker.py RANK PORT OLD NEW CHUNK_MB OUT     (OLD, NEW: ranks of a world of 3)
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_elan.replication.fsdp_reshard import reshard_fsdp

WORLD, WIDTH, LAYERS, BATCH = 3, 2048, 4, 4
FULL_BYTES = 3 * LAYERS * (WIDTH * WIDTH + WIDTH) * 4  # parameters + exp_avg + exp_avg_sq, float32


def new_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def shard(model: nn.Sequential, mesh: DeviceMesh) -> None:
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def shard_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's shards: its parameters' local rows and the optimizer states sharded like them."""
    total = sum(p.to_local().nbytes for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(value.to_local().nbytes for value in state.values() if hasattr(value, "to_local"))
    return total


def reference() -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process, the whole model, the same step."""
    model = new_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(BATCH, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def error(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """The largest difference of the resharded parameters and Adam moments from the reference's (one at a time)."""
    expected_model, expected_optimizer = reference()
    worst = 0.0
    for p, q in zip(model.parameters(), expected_model.parameters(), strict=True):
        pairs = [(p, q)] + [(optimizer.state[p][key], expected_optimizer.state[q][key]) for key in ("exp_avg",
                                                                                              "exp_avg_sq")]
        for sharded, whole in pairs:
            worst = max(worst, (sharded.full_tensor() - whole.detach()).abs().max().item())
    return worst


def main() -> None:
    rank, port, chunk_mb, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[5]), sys.argv[6]
    old, new = ([int(r) for r in ranks.split(",")] for ranks in sys.argv[3:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    old_group, new_group = dist.new_group(old), dist.new_group(new)
    if rank in old:
        model = new_model()
        shard(model, DeviceMesh.from_group(old_group, "cpu"))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.ones(BATCH, WIDTH)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        with torch.device("meta"):
            model = new_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mesh = DeviceMesh.from_group(new_group, "cpu") if rank in new else None
    options = {"chunk_bytes": chunk_mb << 20} if "chunk_bytes" in inspect.signature(reshard_fsdp).parameters else {}
    gc.collect()
    dist.barrier()
    before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident set
    reshard_fsdp(model, [optimizer], shard, old, new, mesh, **options)
    peak = status_kb("VmHWM")
    result = {"growth": (peak - before) << 10, "new_shard": shard_bytes(model, optimizer) if rank in new else 0,
              "full": FULL_BYTES, "chunk": chunk_mb << 20}
    if rank in new:
        result["param_shard"] = max(-(-p.shape[0] // len(new)) * p[0].numel() * p.element_size()
                                    for p in model.parameters())  # FSDP2's padded shard of the largest parameter
        result["error"] = error(model, optimizer)
        result["steps"] = sorted({float(state["step"]) for state in optimizer.state.values()})
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
