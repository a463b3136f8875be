"""The loaders ``ElasticAccelerator.prepare()`` returns: the training loader follows the job's serial position, an
evaluation loader is sharded over the world of the moment it is iterated. The training loader drives its loop's batch
boundaries through :class:`BatchBoundaries`, which the accelerator implements."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from lightning_elan.accelerate import compat
from lightning_elan.data.loader import ElasticDataLoader

log = logging.getLogger(__name__)

__all__ = ["BatchBoundaries", "ElasticTrainLoader", "EvaluationLoader", "LeftTheJob", "refuse_unsupported"]


class LeftTheJob(Exception):
    """Raised by the accelerator when this worker left the job at a batch boundary; ends the training loop."""


class BatchBoundaries(Protocol):
    """What the training loader asks of the loop it belongs to (``ElasticAccelerator`` implements it)."""

    def start_iteration(self, loader: ElasticTrainLoader) -> None:
        """A new pass over ``loader`` begins: end a batch left open, start the next epoch when this one is complete."""

    def batch_boundary(self) -> None:
        """Between two batches: report, coordinate, adjust or recover; ``LeftTheJob`` once this worker left."""

    def epoch_complete(self) -> bool:
        """Every global batch of the epoch has been taken."""

    def take_global_batch(self, loader: ElasticTrainLoader) -> None:
        """This worker takes its share of the next global batch (the job's position moves on)."""


def refuse_unsupported(loader: DataLoader, dispatch_batches: bool | None) -> None:
    """What the elastic training loader cannot do yet, refused with the reason."""
    if dispatch_batches:
        raise NotImplementedError("ElasticAccelerator does not support dispatch_batches=True: every worker reads its "
                                  "own share of each global batch (DataLoaderConfiguration(dispatch_batches=False))")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise NotImplementedError("ElasticAccelerator's training DataLoader needs a map-style dataset (exactly once "
                                  "per epoch is kept by serial position); an IterableDataset is not supported yet")
    if loader.batch_size is None:
        raise ValueError("ElasticAccelerator needs a training DataLoader built with `batch_size` "
                         "(no custom `batch_sampler`)")


class ElasticTrainLoader:
    """The prepared training DataLoader: each batch is this worker's share of the next global batch.

    ``len()`` is the number of global batches in an epoch (independent of the world); iterating starts the next epoch
    when the previous one is complete, and otherwise continues at the job's position (a joiner, a resumed run).
    Adjustments happen here, between two batches: the previous batch's boundary runs before the next is taken.
    """

    def __init__(self, loader: ElasticDataLoader, accelerator: BatchBoundaries, device: torch.device | None,
                 non_blocking: bool) -> None:
        self.base = loader
        self._accelerator = accelerator
        self.device = device
        self.non_blocking = non_blocking
        self.end_of_dataloader = False
        self.remainder = -1  # what Accelerate's GradientState reads: no sample is padded here

    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    @property
    def sampler(self) -> Any:
        return self.base.sampler

    def __len__(self) -> int:
        return len(self.base)

    def set_epoch(self, epoch: int) -> None:
        self.base.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        accelerator = self._accelerator
        try:
            accelerator.start_iteration(self)
        except LeftTheJob:
            return
        self.end_of_dataloader = False
        compat.enter_dataloader(self)
        try:
            yield from self._batches(accelerator)
        finally:
            compat.leave_dataloader(self)

    def _batches(self, accelerator: BatchBoundaries) -> Iterator[Any]:
        inner = iter(self.base)
        while True:
            try:
                accelerator.batch_boundary()
            except LeftTheJob:
                return
            if accelerator.epoch_complete():
                return
            batch = next(inner)  # first: a fresh or rebuilt iterator starts at the position of this batch
            accelerator.take_global_batch(self)
            self.end_of_dataloader = accelerator.epoch_complete()
            yield batch if self.device is None else send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def rebuild(self) -> None:
        """Batches prefetched for the old world are dropped; the next comes from the current position."""
        self.base.rebuild()


class EvaluationLoader:
    """An evaluation DataLoader sharded by Accelerate for the world of the moment it is iterated (re-sharded after a
    resize; ``gather_for_metrics`` then drops the padding of the new shards as usual)."""

    def __init__(self, loader: DataLoader, shard: Callable[[DataLoader], Any], world: Callable[[], tuple[int, int]]
                 ) -> None:
        self.base = loader
        self._shard = shard
        self._world = world
        self._sharded: tuple[tuple[int, int], Any] | None = None

    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base.batch_size

    def current(self) -> Any:
        world = self._world()
        if self._sharded is None or self._sharded[0] != world:
            self._sharded = (world, self._shard(self.base))
        return self._sharded[1]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.current())

    def __len__(self) -> int:
        return len(self.current())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "base":
            raise AttributeError(name)
        return getattr(self.current(), name)
