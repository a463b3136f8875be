"""An FSDP2 module and its optimizers sharded again after members died, each dead member's shard from its mirror.

As ``fsdp_reshard.reshard_fsdp`` at a planned resize, but a survivor may hold two old shards — its own and, from its
shard mirror (``shard_mirror.ShardMirror``), the shard of its dead ward — so the old layout is given as ``owners``
(for each old shard, the rank of the group that holds its rows: ``mirror_plan.shard_owners``). Each tensor's rows go
straight from their owner to their new holder (``mirror_plan.owned_row_moves``), one message per move.
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
    _held_shards,
    _load_parameter,
    _rebind,
    _release,
    _sharded_kinds,
)
from lightning_elan.replication.mirror_plan import owned_row_moves
from lightning_elan.replication.shard_layout import shard_rows
from lightning_elan.replication.shard_mirror import Rows
from lightning_elan.torch_compat import undo_fully_shard

__all__ = ["recover_fsdp"]

TAGS_PER_TENSOR = 1 << 10
"""A message's tag: its tensor's number times this, plus the old shard it comes from (two shards of one owner)."""


def recover_fsdp(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], shard_modules: ShardModules,
                 owners: Sequence[int], receivers: Sequence[int], mesh: DeviceMesh | None, group: Any,
                 skeleton: list[dict[str, Any]], own_index: int | None, mirrored: dict[int, Rows]) -> None:
    """Shard ``model`` and ``optimizers`` from the old layout (shard ``i`` held by ``owners[i]``) onto ``mesh``.

    ``own_index``: this member's old shard (None on a joiner); ``mirrored``: the old shards it holds from its mirror,
    by index. Every member of ``group`` calls it with the same ``owners``, ``receivers`` and ``skeleton``."""
    me = group.rank()
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    like = {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in model.named_parameters()}
    held: dict[int, Rows] = dict(mirrored)
    if own_index is not None:
        held[own_index] = _held_shards(model, optimizers, names)
    group_names = [_release(optimizer, names) for optimizer in optimizers]
    if own_index is not None:
        undo_fully_shard(model)
    gc.collect()
    receiving = me in receivers
    if receiving:
        if mesh is None:
            raise ValueError("a receiver of the recovery needs the new mesh")
        shard_modules(model, mesh)
    moved: dict[str, dict[str, Any]] = {}
    number = 0
    for name, shape in like.items():
        for kind in _sharded_kinds(skeleton, name):
            olds = {index: rows[name].pop(kind) for index, rows in held.items() if kind in rows.get(name, {})}
            rows = _move_owned(olds, shape, owners, receivers, group, number * TAGS_PER_TENSOR)
            number += 1
            if rows is not None:
                moved.setdefault(name, {})[kind] = _as_shard(rows, mesh, shape)
        if receiving:
            _load_parameter(model, name, moved[name].pop(PARAM))
    if not receiving:
        return
    parameters = dict(model.named_parameters())
    for index, (optimizer, described) in enumerate(zip(optimizers, skeleton, strict=True)):
        _rebind(optimizer, described, group_names[index], lambda name, key, index=index: moved[name][f"o{index}/{key}"],
                parameters)


def _move_owned(olds: dict[int, torch.Tensor], like: torch.Tensor, owners: Sequence[int], receivers: Sequence[int],
                group: Any, tag: int) -> torch.Tensor | None:
    """This member's new shard of one tensor (None if it receives none), from the old shards it and others own."""
    me = group.rank()
    length, old_world = like.shape[0], len(owners)
    new_shard = None
    if me in receivers:
        start, end = shard_rows(length, len(receivers), list(receivers).index(me))
        new_shard = torch.empty((end - start, *like.shape[1:]), dtype=like.dtype, device="cpu")
        new_start = start
    works, staged = [], []
    for move in owned_row_moves(length, owners, receivers):
        if move.source == me:
            old = olds[move.old_index]
            old_start = shard_rows(length, old_world, move.old_index)[0]
            rows = old[move.start - old_start : move.end - old_start]
            if move.target == me:
                new_shard[move.start - new_start : move.end - new_start] = rows  # type: ignore[index]
            else:
                staged.append(rows.contiguous())
                works.append(group.send([staged[-1]], move.target, tag + move.old_index))
        elif move.target == me:
            into = new_shard[move.start - new_start : move.end - new_start]  # type: ignore[index]
            works.append(group.recv([into], move.source, tag + move.old_index))
    for work in works:
        work.wait()
    return new_shard
