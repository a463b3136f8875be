"""Rows of dim-0-sharded tensors carried from their old holders to their new ones (the elastic sharded strategy's live
reshard, issue 24): each receiver's new shard is allocated once and its rows are received straight into it, point to
point over the group the members share; what a member sends is a view of the shard it holds. So a member's memory
grows by its new shard only, never by a copy of the whole tensor. The moves are ``shard_layout.row_moves``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.replication.shard_layout import RowMove, row_moves, shard_rows

__all__ = ["move_rows"]


def move_rows(held: torch.Tensor | None, length: int, holders: Sequence[int], receivers: Sequence[int],
              like: torch.Tensor | None = None, group: Any | None = None, tag: int = 0) -> torch.Tensor | None:
    """This member's new shard of a tensor of ``length`` rows (None when it receives none).

    ``held`` is its old shard (None when it holds none: a joiner); ``like`` gives a joiner the rows' shape beyond the
    first dimension and the dtype (a meta tensor of the whole shape will do). Every holder and receiver calls it with
    the same arguments but ``held``; ``holders`` and ``receivers`` are ranks of ``group`` (default: the default group;
    else a process group or a c10d backend, used through its own ``send``/``recv``), in shard order. ``tag`` tells
    this tensor's messages from another's between the same two members.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    me = group.rank()
    template = held if held is not None else like
    if template is None:
        raise ValueError("move_rows needs the held shard or a tensor like it")
    new_shard = _new_shard(template, length, receivers, me)
    moves = row_moves(length, holders, receivers)
    held_start = shard_rows(length, len(holders), list(holders).index(me))[0] if me in holders else 0
    new_start = shard_rows(length, len(receivers), list(receivers).index(me))[0] if me in receivers else 0
    works, sending = [], []
    for move in moves:
        if move.source == me and move.target == me:
            new_shard[move.start - new_start : move.end - new_start] = _rows(held, move, held_start)
        elif move.source == me:
            rows = _rows(held, move, held_start)
            sending.append(rows)  # alive until its send completed
            works.append(group.send([rows], move.target, tag))
        elif move.target == me:
            works.append(group.recv([new_shard[move.start - new_start : move.end - new_start]], move.source, tag))
    for work in works:
        work.wait()
    return new_shard


def _new_shard(template: torch.Tensor, length: int, receivers: Sequence[int], me: int) -> torch.Tensor | None:
    if me not in receivers:
        return None
    start, end = shard_rows(length, len(receivers), list(receivers).index(me))
    device = template.device if template.device.type != "meta" else torch.device("cpu")
    return torch.empty((end - start, *template.shape[1:]), dtype=template.dtype, device=device)


def _rows(held: torch.Tensor | None, move: RowMove, held_start: int) -> torch.Tensor:
    if held is None:
        raise ValueError(f"rows {move.start}..{move.end} are to be sent by a member that holds no shard")
    return held[move.start - held_start : move.end - held_start].contiguous()
