"""Gathering tensors whose first dimension differs between the members, as it does in an elastic job.

A user's ``self.all_gather(x)`` (Lightning) stacks one tensor per process, so every process must hold the same shape.
Under DDP they do: ``DistributedSampler`` pads the data so that every process takes equal batches and as many of them.
In an elastic job they need not: a global batch that does not divide by the world size is split unevenly (no sample is
repeated), and a joiner trains fewer batches of the epoch it joins than the members (so the outputs it collected in
``training_step`` for ``on_train_epoch_end`` are fewer). Sent as they are, such tensors tear the collective (gloo
aborts the process: "Received data size doesn't match expected size"). :func:`even_rows` makes them equal first, the
way ``DistributedSampler`` does for DDP: the shorter ones repeat their last row (zeros where a process holds none), with
one warning that says so; tensors that differ in any other dimension are refused on every process alike.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["even_rows"]

MAX_DIMS = 8
"""Tensors of more dimensions are sent as they are (their shapes are not compared)."""

_warned = False


def even_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` padded along dim 0 to the longest of the group's (see the module docstring)."""
    if tensor.dim() == 0 or tensor.dim() > MAX_DIMS:
        return tensor
    shapes = _shapes(tensor, group)
    if all(shape == shapes[0] for shape in shapes):
        return tensor
    if any(shape[1:] != shapes[0][1:] for shape in shapes):
        raise ValueError(f"all_gather: the processes hold tensors of different shapes "
                         f"({_by_rank(shapes)}); only the first dimension may differ (then shorter tensors are padded)")
    longest = max(shape[0] for shape in shapes)
    _warn_once(shapes, longest, group)
    return _padded(tensor, longest)


def _shapes(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[tuple[int, ...]]:
    """Every member's shape of its tensor (one all-gather of ``MAX_DIMS + 1`` integers)."""
    mine = torch.full((MAX_DIMS + 1,), -1, dtype=torch.int64, device=tensor.device)
    mine[0] = tensor.dim()
    mine[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [tuple(int(size) for size in shape[1 : int(shape[0]) + 1].tolist()) for shape in gathered]


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    if tensor.shape[0] == 0:
        return torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])


def _warn_once(shapes: list[tuple[int, ...]], longest: int, group: dist.ProcessGroup | None) -> None:
    global _warned
    if _warned or dist.get_rank(group) != 0:
        return
    _warned = True
    log.warning("all_gather: the processes hold different numbers of rows (%s): in an elastic job a process's share "
                "of a global batch and its number of batches in an epoch change with the membership, so the shorter "
                "tensors were padded to %d rows by repeating their last row (as DistributedSampler pads for DDP). To "
                "reduce exactly, gather each process's sum and count, or log with self.log(..., sync_dist=True) or a "
                "torchmetrics metric", _by_rank(shapes), longest)


def _by_rank(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(f"rank {rank}: {tuple(shape)}" for rank, shape in enumerate(shapes))
