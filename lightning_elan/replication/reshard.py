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

__all__ = ["DEFAULT_CHUNK_BYTES", "move_rows"]

DEFAULT_CHUNK_BYTES = 64 << 20
"""The largest message of a reshard (issue 24: the fixed buffer beside a member's new shard)."""


def move_rows(held: torch.Tensor | None, length: int, holders: Sequence[int], receivers: Sequence[int],
              like: torch.Tensor | None = None, group: Any | None = None, tag: int = 0,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor | None:
    """This member's new shard of a tensor of ``length`` rows (None when it receives none).

    ``held`` is its old shard (None when it holds none: a joiner); ``like`` gives a joiner the rows' shape beyond the
    first dimension and the dtype (a meta tensor of the whole shape will do). Every holder and receiver calls it with
    the same arguments but ``held``; ``holders`` and ``receivers`` are ranks of ``group`` (default: the default group;
    else a process group or a c10d backend, used through its own ``send``/``recv``), in shard order. ``tag`` tells
    this tensor's messages from another's between the same two members. Rows go in messages of at most
    ``chunk_bytes`` (at least one row), views of ``held`` where its rows are contiguous, so no temporary beyond one
    chunk lives at a time.
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
    rows_per_chunk = _rows_per_chunk(template, chunk_bytes)
    incoming = [move for move in moves if move.target == me and move.source != me]
    works = [group.recv([new_shard[start - new_start : end - new_start]], move.source, tag)  # type: ignore[index]
             for move in incoming for start, end in _chunks(move, rows_per_chunk)]
    for move in moves:
        if move.source == me and move.target == me:
            new_shard[move.start - new_start : move.end - new_start] = _rows(held, move.start, move.end, held_start)
        elif move.source == me:
            works += _send_chunks(group, held, move, held_start, rows_per_chunk, tag)
    for work in works:
        work.wait()
    return new_shard


def _send_chunks(group: Any, held: torch.Tensor | None, move: RowMove, held_start: int, rows_per_chunk: int,
                 tag: int) -> list[Any]:
    """Send ``move``'s rows in chunks: views of ``held`` when its rows are contiguous (no copy); otherwise one chunk's
    contiguous copy at a time, its send completed before the next is made."""
    works = []
    for start, end in _chunks(move, rows_per_chunk):
        view = _rows(held, start, end, held_start)
        rows = view.contiguous()
        work = group.send([rows], move.target, tag)
        if rows is view:
            works.append(work)
        else:
            work.wait()  # a copy: freed before the next one is made
    return works


def _rows_per_chunk(template: torch.Tensor, chunk_bytes: int) -> int:
    """How many rows of ``template`` fit in ``chunk_bytes`` (at least one)."""
    row_bytes = template[0].numel() * template.element_size() if template.shape and template.shape[0] else 0
    return max(1, chunk_bytes // row_bytes) if row_bytes else 1 << 62


def _chunks(move: RowMove, rows_per_chunk: int) -> list[tuple[int, int]]:
    """``move``'s rows ``[start, end)`` cut into pieces of at most ``rows_per_chunk`` rows."""
    return [(start, min(start + rows_per_chunk, move.end)) for start in range(move.start, move.end, rows_per_chunk)]


def _new_shard(template: torch.Tensor, length: int, receivers: Sequence[int], me: int) -> torch.Tensor | None:
    if me not in receivers:
        return None
    start, end = shard_rows(length, len(receivers), list(receivers).index(me))
    device = template.device if template.device.type != "meta" else torch.device("cpu")
    return torch.empty((end - start, *template.shape[1:]), dtype=template.dtype, device=device)


def _rows(held: torch.Tensor | None, start: int, end: int, held_start: int) -> torch.Tensor:
    """Rows ``[start, end)`` of ``held`` (whose first row is ``held_start``), a view (contiguous when ``held`` is)."""
    if held is None:
        raise ValueError(f"rows {start}..{end} are to be sent by a member that holds no shard")
    return held[start - held_start : end - held_start]
