"""Serial-position arithmetic: which samples a rank takes at a step (pure, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalShare:
    """One rank's part of one global batch: positions ``[start, stop)`` of the epoch order."""

    start: int
    stop: int
    global_size: int
    world_size: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def loss_weight(self) -> float:
        """Factor that turns DDP's mean of per-rank means into the mean over the global batch."""
        if self.global_size == 0:
            return 0.0
        return self.world_size * self.size / self.global_size


def steps_in_epoch(num_samples: int, global_batch: int, drop_last: bool) -> int:
    """Number of global batches in an epoch of ``num_samples``."""
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    if drop_last:
        return num_samples // global_batch
    return math.ceil(num_samples / global_batch)


def remaining_steps(num_samples: int, position: int, global_batch: int, drop_last: bool) -> int:
    """Global batches left in the epoch after ``position`` samples were consumed."""
    return steps_in_epoch(max(num_samples - position, 0), global_batch, drop_last)


def epoch_steps(
    num_samples: int, global_batch: int, drop_last: bool, steps_before: int = 0, position_before: int = 0
) -> int:
    """Global batches in an epoch whose first ``steps_before`` batches (``position_before`` samples) used an earlier
    global batch and the rest uses ``global_batch``."""
    return steps_before + remaining_steps(num_samples, position_before, global_batch, drop_last)


def epoch_end_position(
    num_samples: int, global_batch: int, drop_last: bool, position_before: int = 0
) -> int:
    """Position at which the epoch ends: ``num_samples``, or with ``drop_last`` the end of the last full global batch
    counted from ``position_before`` (where the current global batch took over)."""
    rest = max(num_samples - position_before, 0)
    steps = steps_in_epoch(rest, global_batch, drop_last)
    return position_before + min(rest, steps * global_batch)


def global_batch_size_at(num_samples: int, position: int, global_batch: int) -> int:
    """Size of the global batch that starts at ``position`` (the last one may be partial)."""
    return max(0, min(global_batch, num_samples - position))


def local_share(position: int, global_size: int, world_size: int, rank: int) -> LocalShare:
    """Contiguous split of ``[position, position + global_size)``; the first ``global_size % world_size`` ranks get one
    more sample."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    base, extra = divmod(global_size, world_size)
    start = position + rank * base + min(rank, extra)
    size = base + (1 if rank < extra else 0)
    return LocalShare(start, start + size, global_size, world_size)


def share_at(position: int, epoch_end: int, global_batch: int, world_size: int, rank: int) -> LocalShare:
    """``rank``'s share of the global batch that starts at ``position`` (the one rule every reader of a share uses)."""
    return local_share(position, global_batch_size_at(epoch_end, position, global_batch), world_size, rank)
