"""An FSDP2 module and its optimizers sharded again after members died, each dead member's shard from its mirror.

As ``fsdp_reshard.reshard_fsdp`` at a planned resize, but a survivor may hold two old shards — its own and, from its
shard mirror (``shard_mirror.ShardMirror``), the shard of its dead ward — so the old layout is given as ``owners``
(for each old shard, the ranks of the group that hold its rows: ``mirror_plan.shard_holders``). Each tensor's rows go
straight from one owner to their new holder (``mirror_plan.owned_row_moves``), in the all-to-all rounds of
``reshard.carry`` (abortable). Either layout may be HSDP's (shards replicated over replica groups, 2-D mesh): the old
one has then several owners per shard, the new one ``shards`` shards, receiver ``p`` taking shard ``p % shards``.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_elan.replication.fsdp_reshard import (
    PARAM,
    ShardModules,
    _as_shard,
    _groups_restored_on_failure,
    _held_shards,
    _load_parameter,
    _rebind,
    _release,
    _sharded_kinds,
    is_fully_sharded,
    tied_aliases,
)
from lightning_elan.replication.mirror_plan import OwnedMove, owned_row_moves
from lightning_elan.replication.reshard import DEFAULT_CHUNK_BYTES, carry
from lightning_elan.replication.shard_layout import shard_rows
from lightning_elan.replication.shard_mirror import Rows
from lightning_elan.torch_compat import undo_fully_shard

__all__ = ["recover_fsdp"]

def recover_fsdp(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], shard_modules: ShardModules,
                 owners: Sequence[Sequence[int]], receivers: Sequence[int], mesh: DeviceMesh | None, group: Any,
                 skeleton: list[dict[str, Any]], own_index: int | None, mirrored: dict[int, Rows],
                 own_rows: Rows | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 shards: int | None = None, hosts: Sequence[str | None] | None = None) -> None:
    """Shard ``model`` and ``optimizers`` from the old layout (shard ``i`` held by ``owners[i]``) onto ``mesh``
    (``shards`` shards; default one per receiver; ``hosts``: each rank's, for the nearest of a shard's holders).

    ``own_index``: this member's old shard (None on a joiner); ``mirrored``: the old shards it holds from its mirror,
    by index; ``own_rows``: its old shard's rows when the module no longer holds them (a reshard abandoned after a
    death left it half moved), else read from the module. Every member of ``group`` calls it with the same ``owners``,
    ``receivers`` and ``skeleton``. The old rows are only read: a caller that keeps them can start again from them."""
    me = group.rank()
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    like = {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in model.named_parameters()}
    aliases = tied_aliases(model)
    held: dict[int, Rows] = dict(mirrored)
    if own_index is not None:
        held[own_index] = own_rows if own_rows is not None else _held_shards(model, optimizers, names)
    group_names = [_release(optimizer, names) for optimizer in optimizers]
    with _groups_restored_on_failure(model, optimizers, group_names):
        if is_fully_sharded(model):
            undo_fully_shard(model)
        gc.collect()
        receiving = me in receivers
        if receiving:
            if mesh is None:
                raise ValueError("a receiver of the recovery needs the new mesh")
            shard_modules(model, mesh)
        moved: dict[str, dict[str, Any]] = {}
        for name, shape in like.items():
            for kind in _sharded_kinds(skeleton, name):
                olds = {index: rows[name][kind] for index, rows in held.items() if kind in rows.get(name, {})}
                rows = _move_owned(olds, shape, owners, receivers, group, chunk_bytes, shards, hosts)
                if rows is not None:
                    moved.setdefault(name, {})[kind] = _as_shard(rows, mesh, shape)
            if receiving:
                _load_parameter(model, name, moved[name].pop(PARAM), aliases.get(name, ()))
        if not receiving:
            return
        parameters = dict(model.named_parameters())
        for index, (optimizer, described) in enumerate(zip(optimizers, skeleton, strict=True)):
            _rebind(optimizer, described, group_names[index],
                    lambda name, key, index=index: moved[name][f"o{index}/{key}"], parameters)


def _move_owned(olds: dict[int, torch.Tensor], like: torch.Tensor, owners: Sequence[Sequence[int]],
                receivers: Sequence[int], group: Any, chunk_bytes: int, shards: int | None,
                hosts: Sequence[str | None] | None) -> torch.Tensor | None:
    """This member's new shard of one tensor (None if it receives none), from the old shards it and others own."""
    me = group.rank()
    length, old_world = like.shape[0], len(owners)
    shards = len(receivers) if shards is None else shards
    new_shard, new_start = None, 0
    if me in receivers:
        new_start, end = shard_rows(length, shards, list(receivers).index(me) % shards)
        new_shard = torch.empty((end - new_start, *like.shape[1:]), dtype=like.dtype, device="cpu")

    def source_rows(move: OwnedMove, start: int, end: int) -> torch.Tensor:
        old_start = shard_rows(length, old_world, move.old_index)[0]
        return olds[move.old_index][start - old_start : end - old_start]

    carry(group, owned_row_moves(length, owners, receivers, shards, hosts), source_rows,
          lambda _move, start, end: new_shard[start - new_start : end - new_start],  # type: ignore[index]
          like, chunk_bytes)
    return new_shard
