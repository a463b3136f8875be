"""Rows of dim-0-sharded tensors carried from their old holders to their new ones (the elastic sharded strategy's live
reshard, issue 24): each receiver's new shard is allocated once and its rows are received straight into it, point to
point over the group the members share, in all-to-all rounds (abortable: a member's death releases every other); what a
member sends is a view of the shard it holds where a round allows it. So a member's memory grows by its new shard and
one chunk, never by a copy of the whole tensor. The moves are ``shard_layout.row_moves``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.replication.shard_layout import row_moves, shard_rows

__all__ = ["DEFAULT_CHUNK_BYTES", "carry", "exchange", "move_rows"]

DEFAULT_CHUNK_BYTES = 64 << 20
"""The largest message of a reshard (issue 24: the fixed buffer beside a member's new shard)."""


def move_rows(held: torch.Tensor | None, length: int, holders: Sequence[int], receivers: Sequence[int],
              like: torch.Tensor | None = None, group: Any | None = None, tag: int = 0,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor | None:
    """This member's new shard of a tensor of ``length`` rows (None when it receives none).

    ``held`` is its old shard (None when it holds none: a joiner); ``like`` gives a joiner the rows' shape beyond the
    first dimension and the dtype (a meta tensor of the whole shape will do). Every member of ``group`` calls it with
    the same arguments but ``held``; ``holders`` and ``receivers`` are ranks of ``group`` (default: the default group;
    else a process group, a c10d backend or a side group, used through its own ``alltoall_base``), in shard order.
    ``tag`` is unused (the rows travel in all-to-alls, in the same order on every member). Rows go in pieces of at most
    ``chunk_bytes`` a round (see :func:`carry`), views of ``held`` and of the new shard where a round allows it.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    me = group.rank()
    template = held if held is not None else like
    if template is None:
        raise ValueError("move_rows needs the held shard or a tensor like it")
    new_shard = _new_shard(template, length, receivers, me)
    held_start = shard_rows(length, len(holders), list(holders).index(me))[0] if me in holders else 0
    new_start = shard_rows(length, len(receivers), list(receivers).index(me))[0] if me in receivers else 0
    carry(group, row_moves(length, holders, receivers), lambda _move, start, end: _rows(held, start, end, held_start),
          lambda _move, start, end: new_shard[start - new_start : end - new_start],  # type: ignore[index]
          template, chunk_bytes)
    return new_shard


Rows = Callable[[Any, int, int], torch.Tensor]
"""The rows ``[start, end)`` of a move (a view of the tensor they come from, or go to)."""


def carry(group: Any, moves: Sequence[Any], source_rows: Rows, target_rows: Rows, template: torch.Tensor,
          chunk_bytes: int) -> None:
    """Carry every move's rows (``source``, ``target``, ``start``, ``end``: ranks of ``group``, rows of one tensor)
    from ``source_rows`` on its source to ``target_rows`` on its target. Every member of ``group`` calls it with the
    same ``moves`` (in the same order) and ``chunk_bytes``; a move within a member is a local copy.

    The rows travel in rounds of one ``alltoall_base`` each, never point to point: gloo's send and receive have no
    future, so a member's death could not release a survivor waiting in one (the live reshard's hang), while an
    all-to-all's work is abortable (``ElasticProcessGroup.side_group``, a generation's view). In a round each move
    sends its next piece; pieces are sized so that a member's staging (its pieces gathered into one buffer, and the
    buffer received into, when a round is not one view each way) stays within ``chunk_bytes``."""
    me = group.rank()
    for move in moves:
        if move.source == me and move.target == me:
            target_rows(move, move.start, move.end).copy_(source_rows(move, move.start, move.end))
    remote = [move for move in moves if move.source != move.target]
    if not remote:
        return
    rows_per_piece = _rows_per_chunk(template, max(1, chunk_bytes // (2 * _most_pieces(remote))))
    rounds = max(len(_chunks(move, rows_per_piece)) for move in remote)
    for round_ in range(rounds):
        pieces = [(move, _chunks(move, rows_per_piece)[round_]) for move in remote
                  if round_ < len(_chunks(move, rows_per_piece))]
        sends = [(move.target, source_rows(move, *rows)) for move, rows in pieces if move.source == me]
        receives = [(move.source, target_rows(move, *rows)) for move, rows in pieces if move.target == me]
        exchange(group, sends, receives)


def _most_pieces(moves: Sequence[Any]) -> int:
    """The most moves one member takes part in (sending or receiving): its pieces in one round."""
    counts: dict[int, int] = {}
    for move in moves:
        counts[move.source] = counts.get(move.source, 0) + 1
        counts[move.target] = counts.get(move.target, 0) + 1
    return max(counts.values())


def exchange(group: Any, sends: Sequence[tuple[int, torch.Tensor]],
             receives: Sequence[tuple[int, torch.Tensor]]) -> None:
    """One ``alltoall_base`` over ``group`` (every member calls it): each ``(peer, tensor)`` of ``sends`` to its peer,
    each of ``receives`` filled from its peer, several for one peer in the order the peer sends them. The tensors
    travel as bytes, so any dtypes and shapes may meet; one contiguous tensor each way is used in place, more are
    gathered into (scattered from) a buffer."""
    size = group.size()
    outgoing = _as_bytes([tensor for _, tensor in sorted(sends, key=lambda pair: pair[0])])
    incoming_views = [tensor for _, tensor in sorted(receives, key=lambda pair: pair[0])]
    incoming = _receive_buffer(incoming_views)
    work = group.alltoall_base(incoming, outgoing, _byte_counts(receives, size), _byte_counts(sends, size),
                               dist.AllToAllOptions())
    work.wait()
    if incoming_views and not _is_bytes_of(incoming, incoming_views):
        offset = 0
        for view in incoming_views:
            nbytes = view.numel() * view.element_size()
            view.copy_(incoming[offset : offset + nbytes].view(view.dtype).view(view.shape))
            offset += nbytes


def _byte_counts(pairs: Sequence[tuple[int, torch.Tensor]], size: int) -> list[int]:
    counts = [0] * size
    for peer, tensor in pairs:
        counts[peer] += tensor.numel() * tensor.element_size()
    return counts


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` one after the other as one contiguous byte tensor (a view of the only one, when it is contiguous)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return _bytes(tensors[0])
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([_bytes(tensor.contiguous()) for tensor in tensors])


def _receive_buffer(views: list[torch.Tensor]) -> torch.Tensor:
    if len(views) == 1 and views[0].is_contiguous():
        return _bytes(views[0])
    return torch.empty(sum(view.numel() * view.element_size() for view in views), dtype=torch.uint8)


def _is_bytes_of(buffer: torch.Tensor, views: list[torch.Tensor]) -> bool:
    return len(views) == 1 and views[0].is_contiguous() and buffer.data_ptr() == views[0].data_ptr()


def _rows_per_chunk(template: torch.Tensor, chunk_bytes: int) -> int:
    """How many rows of ``template`` fit in ``chunk_bytes`` (at least one)."""
    row_bytes = template[0].numel() * template.element_size() if template.shape and template.shape[0] else 0
    return max(1, chunk_bytes // row_bytes) if row_bytes else 1 << 62


def _chunks(move: Any, rows_per_chunk: int) -> list[tuple[int, int]]:
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
