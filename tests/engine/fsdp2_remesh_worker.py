"""One rank of ``test_fsdp2_remesh.py``: a float64 MLP trained with FSDP2 (``fully_shard``) on the ranks ``OLD``,
then sharded again, in place, on the ranks ``NEW`` and trained on: each rank of ``NEW`` receives only the rows of its
new shard (parameters and Adam's moments) from the ranks that held them, by point-to-point over gloo; a rank that
joins builds the module on the meta device (no full copy). The upstream behaviour ``elan_fsdp`` (issue 24) will stand
on: ``fully_shard``'s state, hooks and class swap can be undone on a module, and ``fully_shard`` applied again on
another mesh, with the local shards loaded by ``load_state_dict(assign=True)``.

    python fsdp2_remesh_worker.py RANK PORT OLD NEW OUT     (OLD, NEW: comma-separated ranks of a world of 3)
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
from torch.distributed.tensor import DTensor, Shard

WORLD, GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER, LR = 3, 12, 2, 2, 0.01
MOMENTS = ("exp_avg", "exp_avg_sq")


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


def rows(length: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of a rank (``_chunk_with_empty``: chunks of ⌈length/world⌉, the last ones short or
    empty)."""
    chunk = -(-length // world)
    return min(rank * chunk, length), min((rank + 1) * chunk, length)


def undo_fully_shard(model: nn.Module) -> None:
    """Take FSDP2 off every module (torch 2.13): the forward hooks ``FSDPState.init`` registered, the state-dict
    hooks of each ``FSDPParamGroup`` (``_register_state_dict_hooks``) and ``FSDPParam`` (``_post_load_hook_handle``:
    left, an old parameter would re-pad a new shard to the old layout at ``load_state_dict``), the state ``contract``
    keeps in the module's ``__dict__`` and in ``_module_state_mapping``, the ``FSDP<Class>`` class
    ``_apply_to_module`` swapped in; each sharded parameter becomes a meta tensor of its full shape."""
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is None:
            continue
        if state._modules[0] is module:
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    fsdp_param._post_load_hook_handle.remove()
                for handles in (group._module_to_pre_save_state_dict_hook_handle,
                                group._module_to_pre_load_state_dict_hook_handle):
                    for handle in handles.values():
                        handle.remove()
        _module_state_mapping.pop(module, None)
        for key in [key for key in module.__dict__ if key.startswith("__composable_api_")]:
            del module.__dict__[key]
        if isinstance(module, FSDPModule):
            module.__class__ = module.__class__.__bases__[1]
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(flag, None)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta")))


def move_rows(local: torch.Tensor | None, length: int, rest: tuple[int, ...], old: list[int],
              new: list[int]) -> torch.Tensor | None:
    """This rank's rows of the new layout, from the old holders: local rows copied, the others point to point."""
    me = dist.get_rank()
    start, end = rows(length, len(new), new.index(me)) if me in new else (0, 0)
    mine = torch.empty((end - start, *rest), dtype=torch.float64) if me in new else None
    ops, landing = [], []
    if me in old:
        held_start, held_end = rows(length, len(old), old.index(me))
        for peer in new:
            peer_start, peer_end = rows(length, len(new), new.index(peer))
            lo, hi = max(peer_start, held_start), min(peer_end, held_end)
            if lo >= hi:
                continue
            piece = local[lo - held_start : hi - held_start].contiguous()
            if peer == me:
                mine[lo - start : hi - start] = piece
            else:
                ops.append(dist.P2POp(dist.isend, piece, peer))
    if me in new:
        for holder in old:
            held_start, held_end = rows(length, len(old), old.index(holder))
            lo, hi = max(start, held_start), min(end, held_end)
            if holder != me and lo < hi:
                landing.append((mine[lo - start : hi - start], torch.empty((hi - lo, *rest), dtype=torch.float64)))
                ops.append(dist.P2POp(dist.irecv, landing[-1][1], holder))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for destination, received in landing:
        destination.copy_(received)
    return mine


def main() -> None:
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[5]
    old, new = ([int(r) for r in ranks.split(",")] for ranks in sys.argv[3:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    old_group, new_group = dist.new_group(old), dist.new_group(new)
    model, shapes = new_model(), {name: p.shape for name, p in new_model().named_parameters()}
    held: dict[str, dict[str, torch.Tensor]] = {}
    if rank in old:
        shard(model, DeviceMesh.from_group(old_group, "cpu"))
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        train(model, optimizer, old, STEPS_BEFORE)
        held = {name: {"param": p._local_tensor.detach(), **{k: optimizer.state[p][k]._local_tensor for k in MOMENTS}}
                for name, p in model.named_parameters()}
        undo_fully_shard(model)
    else:
        with torch.device("meta"):
            model = new_model()
    moved = {name: {kind: move_rows(held.get(name, {}).get(kind), shape[0], tuple(shape[1:]), old, new)
                    for kind in ("param", *MOMENTS)} for name, shape in shapes.items()}
    if rank in new:
        mesh = DeviceMesh.from_group(new_group, "cpu")
        shard(model, mesh)

        def sharded(name: str, kind: str) -> DTensor:
            return DTensor.from_local(moved[name][kind], mesh, [Shard(0)], shape=shapes[name],
                                      stride=torch.empty(shapes[name], device="meta").stride(), run_check=False)

        model.load_state_dict({name: nn.Parameter(sharded(name, "param")) for name in shapes}, assign=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        for name, p in model.named_parameters():
            optimizer.state[p] = {"step": torch.tensor(float(STEPS_BEFORE)), **{k: sharded(name, k) for k in MOMENTS}}
        train(model, optimizer, new, STEPS_AFTER)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        expected = reference()
        error = max((full[name] - expected[name]).abs().max().item() for name in shapes)
        local_rows = {name: list(moved[name]["param"].shape) for name in shapes}
        with open(out, "w") as f:
            json.dump({"error": error, "rows": local_rows}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
