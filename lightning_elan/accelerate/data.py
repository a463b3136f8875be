"""The loaders ``ElasticAccelerator.prepare()`` returns: the training loader follows the job's serial position; an
evaluation loader cuts each pass into batches for the world of the moment and, when a member dies during the pass,
gives the survivors what the dead had not evaluated (:mod:`~lightning_elan.accelerate.evaluation`); one it cannot cut
itself is sharded by Accelerate for the world of the moment it is iterated. The training loader drives its loop's batch
boundaries through :class:`BatchBoundaries` (the accelerator implements it), the evaluation loader tells its passes
through :class:`EvaluationHost` (the accelerator's
:class:`~lightning_elan.accelerate.evaluation_recovery.EvaluationRecovery`). Each stands in front of the user's loader
(:class:`UserLoaderFront`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, SequentialSampler
from typing_extensions import override

from lightning_elan.accelerate import compat
from lightning_elan.accelerate.evaluation import EvaluationPass
from lightning_elan.data.loader import ElasticDataLoader, carried_arguments

log = logging.getLogger(__name__)

__all__ = ["BatchBoundaries", "ElasticEvaluationLoader", "ElasticTrainLoader", "EvaluationHost", "EvaluationLoader",
           "ForwardingLoaderFront", "LeftTheJob", "UserLoaderFront", "evaluation_unsupported", "refuse_unsupported"]


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


class UserLoaderFront:
    """A prepared loader in front of the user's (``base``): its ``dataset``, ``batch_size`` and ``sampler`` are
    ``base``'s."""

    def __init__(self, base: Any) -> None:
        self.base = base

    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base.batch_size

    @property
    def sampler(self) -> Any:
        return self.base.sampler


class ForwardingLoaderFront(UserLoaderFront):
    """A :class:`UserLoaderFront` that reads any other public attribute from :meth:`_forwarded_to` (``base``)."""

    def _forwarded_to(self) -> Any:
        """The loader whose attributes this one does not define are read."""
        return self.base

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "base":
            raise AttributeError(name)
        return getattr(self._forwarded_to(), name)


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


class ElasticTrainLoader(UserLoaderFront):
    """The prepared training DataLoader: each batch is this worker's share of the next global batch.

    ``len()`` is the number of global batches in an epoch (independent of the world); iterating starts the next epoch
    when the previous one is complete, and otherwise continues at the job's position (a joiner, a resumed run).
    Adjustments happen here, between two batches: the previous batch's boundary runs before the next is taken.
    """

    def __init__(self, loader: ElasticDataLoader, accelerator: BatchBoundaries, device: torch.device | None,
                 non_blocking: bool) -> None:
        super().__init__(loader)
        self._accelerator = accelerator
        self.device = device
        self.non_blocking = non_blocking
        self.end_of_dataloader = False
        self.remainder = -1  # what Accelerate's GradientState reads: no sample is padded here

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


class EvaluationLoader(ForwardingLoaderFront):
    """An evaluation DataLoader the elastic loader cannot cut itself (:func:`evaluation_unsupported`), sharded by
    Accelerate for the world of the moment it is iterated (re-sharded after a resize; ``gather_for_metrics`` then drops
    the padding of the new shards as usual). A member's death during a pass loses the dead member's samples of it:
    the accelerator warns."""

    def __init__(self, loader: DataLoader, shard: Callable[[DataLoader], Any], host: EvaluationHost,
                 unsupported: str) -> None:
        super().__init__(loader)
        self._shard = shard
        self._host = host
        self._unsupported = unsupported
        self._sharded: tuple[tuple[int, int], Any] | None = None

    @property
    @override
    def sampler(self) -> Any:
        """The sampler of the loader Accelerate sharded for the world of the moment."""
        return self.current().sampler

    def current(self) -> Any:
        """The user's loader sharded by Accelerate for the world of the moment (sharded again after a resize)."""
        world = self._host.evaluation_world()
        if self._sharded is None or self._sharded[0] != world:
            self._sharded = (world, self._shard(self.base))
        return self._sharded[1]

    def __iter__(self) -> Iterator[Any]:
        sharded = self.current()
        self._host.evaluation_started(None, self._unsupported)
        try:
            yield from sharded
        finally:
            self._host.evaluation_ended(None)

    def __len__(self) -> int:
        return len(self.current())

    @override
    def _forwarded_to(self) -> Any:
        return self.current()


class EvaluationHost(Protocol):
    """What an evaluation loader tells the accelerator (its ``EvaluationRecovery`` implements it)."""

    def evaluation_world(self) -> tuple[int, int]:
        """This process's rank and the world size a new pass is cut for."""

    def evaluation_started(self, evaluation: EvaluationPass | None, unsupported: str | None = None) -> None:
        """A pass begins: a member's death during it is recovered from at once. None: a pass of a loader Accelerate
        shards, which cannot give a dead member's samples to the survivors (``unsupported`` says why)."""

    def evaluation_ended(self, evaluation: EvaluationPass | None) -> None:
        """The pass is over (exhausted, or its loop left)."""


def evaluation_unsupported(loader: DataLoader, even_batches: bool, split_batches: bool) -> str | None:
    """Why the elastic evaluation loader cannot cut ``loader``'s passes itself (None: it can)."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return "its dataset is an IterableDataset"
    if loader.batch_size is None:
        return "it has a custom batch_sampler"
    if not isinstance(loader.sampler, SequentialSampler):
        return f"its sampler is a {type(loader.sampler).__name__}, not sequential"
    if loader.drop_last:
        return "it drops its last batch"
    if split_batches or not even_batches:
        return "the accelerator's split_batches=True or even_batches=False"
    return None


class ElasticEvaluationLoader(ForwardingLoaderFront):
    """The prepared evaluation DataLoader: each pass evaluates every sample once, on the world of the moment, also
    when a member dies during the pass (see :mod:`~lightning_elan.accelerate.evaluation`). Batches are the user's
    loader's (dataset, collation, workers), padded at the end of a pass as Accelerate pads them; use
    ``gather_for_metrics`` to drop the padding."""

    def __init__(self, loader: DataLoader, host: EvaluationHost, device: torch.device | None,
                 non_blocking: bool) -> None:
        super().__init__(loader)
        self._host = host
        self.device = device
        self.non_blocking = non_blocking
        self.end_of_dataloader = False
        self.remainder = -1  # what Accelerate's GradientState reads: the accelerator drops the padding itself

    @property
    def total_batch_size(self) -> int:
        return self.base.batch_size * self._host.evaluation_world()[1]

    @property
    def total_dataset_length(self) -> int:
        return len(self.base.dataset)

    def __len__(self) -> int:
        """Batches of a pass that starts now, on every process."""
        return math.ceil(len(self.base.sampler) / self.total_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Nothing: a sequential order is every epoch's."""

    def __iter__(self) -> Iterator[Any]:
        rank, world = self._host.evaluation_world()
        evaluation = EvaluationPass(tuple(self.base.sampler), world, rank, self.base.batch_size)
        self._host.evaluation_started(evaluation)
        self.end_of_dataloader = False
        compat.enter_dataloader(self)
        try:
            yield from self._batches(evaluation)
        finally:
            compat.leave_dataloader(self)
            self._host.evaluation_ended(evaluation)

    def _batches(self, evaluation: EvaluationPass) -> Iterator[Any]:
        batches: Iterator[Any] | None = None
        while evaluation.next_batch() is not None:
            if batches is None or evaluation.replanned:
                batches = iter(self._plan_loader(evaluation))
            batch = next(batches)
            self.end_of_dataloader = evaluation.is_last_batch
            yield batch if self.device is None else send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def _plan_loader(self, evaluation: EvaluationPass) -> DataLoader:
        """The user's loader over this process's batches of the pass's current plan."""
        plan = evaluation.plan
        batches = [plan.indices(batch, evaluation.rank) for batch in range(len(plan))]
        return DataLoader(self.base.dataset, batch_sampler=batches, **carried_arguments(self.base))
