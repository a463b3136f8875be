"""Elastic sampling: one seeded epoch order, consumed by position, split over the live world."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sized
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_elan.data.positions import (
    LocalShare,
    epoch_end_position,
    epoch_steps,
    remaining_steps,
    share_at,
)

log = logging.getLogger(__name__)

WorldView = Callable[[], tuple[int, int]]
"""Returns ``(rank, world_size)`` of the current generation."""


@dataclass
class DataPosition:
    """The whole data state of a job: epoch, samples consumed in it, and the global batch size.

    Its methods are the only writers of these fields (the elastic worker owns the one instance of a process).

    When the global batch changes mid-epoch, ``steps_before``/``position_before`` remember how many global batches
    (and samples) of this epoch were cut with earlier sizes: the rest of the epoch is cut from ``position_before``.
    """

    epoch: int = 0
    position: int = 0
    global_batch: int | None = None
    steps_before: int = 0
    position_before: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.global_batch = None if state.get("global_batch") is None else int(state["global_batch"])
        self.steps_before = int(state.get("steps_before", 0))
        self.position_before = int(state.get("position_before", 0))

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self.steps_before, self.position_before = epoch, 0, 0, 0

    def steps_done(self) -> int:
        """Global batches of this epoch taken so far (the last one may have been partial)."""
        if self.global_batch is None:
            return 0
        return self.steps_before + math.ceil((self.position - self.position_before) / self.global_batch)

    def advance(self, epoch_end: int, world_size: int, rank: int) -> LocalShare:
        """Take the next global batch: ``rank``'s share of it; the position moves past it (at most to ``epoch_end``)."""
        assert self.global_batch is not None, "global batch not set"
        share = share_at(self.position, epoch_end, self.global_batch, world_size, rank)
        self.position = min(epoch_end, self.position + self.global_batch)
        return share

    def change_global_batch(self, global_batch: int) -> None:
        """Cut the rest of the epoch, from the current position, into global batches of ``global_batch``."""
        if global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {global_batch}")
        if self.global_batch is not None and global_batch != self.global_batch:
            self.steps_before, self.position_before = self.steps_done(), self.position
        self.global_batch = global_batch


class EpochOrder:
    """The order in which an epoch visits the dataset: a seeded permutation, the identity, or a user sampler's."""

    def __init__(self, num_samples: int, shuffle: bool, seed: int, user_sampler: Sampler | None = None) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self._user_sampler = user_sampler
        self._cached: tuple[int, list[int]] | None = None

    def indices(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._compute(epoch))
        return self._cached[1]

    def _compute(self, epoch: int) -> list[int]:
        if self._user_sampler is not None:
            if callable(getattr(self._user_sampler, "set_epoch", None)):
                self._user_sampler.set_epoch(epoch)
            return list(iter(self._user_sampler))
        if not self.shuffle:
            return list(range(self.num_samples))
        # the same permutation as torch's DistributedSampler for (seed, epoch)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def state_dict(self) -> dict[str, Any] | None:
        """What another process needs to visit the epochs as this one does, or None (a seeded order, computed alike
        everywhere): a user sampler's order of the current epoch, and its generator's state once it drew that order
        (a ``WeightedRandomSampler(generator=…)`` draws the next epoch's order from there)."""
        if self._user_sampler is None or self._cached is None:
            return None
        generator = getattr(self._user_sampler, "generator", None)
        return {"epoch": self._cached[0], "indices": list(self._cached[1]),
                "generator": generator.get_state() if isinstance(generator, torch.Generator) else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take another process's :meth:`state_dict` (a joiner: its source's)."""
        if state is None or self._user_sampler is None:
            return
        self._cached = (int(state["epoch"]), [int(index) for index in state["indices"]])
        generator = getattr(self._user_sampler, "generator", None)
        if state["generator"] is not None and isinstance(generator, torch.Generator):
            generator.set_state(state["generator"])

    @classmethod
    def from_sampler(cls, sampler: Sampler, num_samples: int, seed: int) -> EpochOrder:
        if isinstance(sampler, RandomSampler):
            return cls(num_samples, shuffle=True, seed=seed)
        if isinstance(sampler, SequentialSampler):
            return cls(num_samples, shuffle=False, seed=seed)
        if isinstance(sampler, DistributedSampler):
            return cls._from_distributed_sampler(sampler)
        log.warning(
            "Using the order of the user sampler %s; it must give the same order on every worker for an epoch (a "
            "joiner takes the current epoch's order and the sampler's generator state from its source).",
            type(sampler).__name__,
        )
        length = len(sampler) if isinstance(sampler, Sized) else num_samples
        return cls(length, shuffle=False, seed=seed, user_sampler=sampler)


    @classmethod
    def _from_distributed_sampler(cls, sampler: DistributedSampler) -> EpochOrder:
        """A user's ``DistributedSampler`` yields one rank's share of a fixed world: the epoch visits its global order
        instead (its seeded permutation, or the identity) and each global batch is shared among the current workers —
        its ``num_replicas``, ``rank`` and padding do not apply. Its shares, taken as the order, trained each process on
        a share of a share (a quarter of the data on 2 workers, exit 0)."""
        if type(sampler).__iter__ is not DistributedSampler.__iter__:
            raise ValueError(
                f"{type(sampler).__name__} is a DistributedSampler with its own __iter__: it yields one process's "
                "share of an order lightning_elan cannot see, for a fixed number of processes. Give the DataLoader a "
                "sampler of the whole dataset (lightning_elan shares each global batch among the workers of the "
                "moment)."
            )
        log.info("the DataLoader's DistributedSampler (shuffle=%s, seed=%d) gives the epoch order; lightning_elan "
                 "shares each global batch among the current workers", sampler.shuffle, sampler.seed)
        return cls(len(sampler.dataset), shuffle=sampler.shuffle, seed=sampler.seed)  # type: ignore[arg-type]


class ElasticSampler(Sampler[int]):
    """Epoch order and data position; Lightning calls ``set_epoch`` on it through the loader's ``sampler``."""

    def __init__(self, order: EpochOrder, data: DataPosition, drop_last: bool) -> None:
        self.order = order
        self.data = data
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.data.epoch:
            self.data.start_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order.indices(self.data.epoch))

    def __len__(self) -> int:
        return self.order.num_samples

    def epoch_end(self) -> int:
        """Position at which the epoch ends (excludes the dropped last partial batch)."""
        return epoch_end_position(self.order.num_samples, self._global_batch(), self.drop_last,
                                  self.data.position_before)

    def epoch_steps(self) -> int:
        """Global batches in the current epoch, counting those taken with an earlier global batch."""
        data = self.data
        return epoch_steps(self.order.num_samples, self._global_batch(), self.drop_last, data.steps_before,
                           data.position_before)

    def _global_batch(self) -> int:
        assert self.data.global_batch is not None, "global batch not set"
        return self.data.global_batch


class ElasticBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices of every remaining global batch of the epoch, from the live position and world."""

    def __init__(self, sampler: ElasticSampler, world: WorldView) -> None:
        self.sampler = sampler
        self.world = world

    def __iter__(self) -> Iterator[list[int]]:
        data = self.sampler.data
        indices = self.sampler.order.indices(data.epoch)
        rank, world_size = self.world()
        position, end, batch = data.position, self.sampler.epoch_end(), self.sampler._global_batch()
        while position < end:
            yield self._local_indices(indices, share_at(position, end, batch, world_size, rank), position)
            position += batch

    @staticmethod
    def _local_indices(indices: list[int], share: LocalShare, position: int) -> list[int]:
        if share.size == 0:
            # a rank with no sample still runs forward/backward (its loss is weighted 0): give it a stand-in sample
            return [indices[position]]
        return indices[share.start : share.stop]

    def __len__(self) -> int:
        """Global batches in the whole epoch (Lightning adds the batches already done when it resumes), including
        those taken before a change of the global batch in this epoch."""
        return self.sampler.epoch_steps()

    def remaining(self) -> int:
        data = self.sampler.data
        return remaining_steps(self.sampler.epoch_end(), data.position, self.sampler._global_batch(), False)
