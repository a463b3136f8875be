"""A DataLoader stand-in whose iterator can be rebuilt from the data position after a resize."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_elan.data.sampler import DataPosition, ElasticBatchSampler, ElasticSampler, EpochOrder, WorldView

log = logging.getLogger(__name__)

# DataLoader arguments carried over from the user's loader (everything but how batches are formed)
_CARRIED_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def carried_arguments(user_loader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader arguments a loader that forms its own batches keeps (workers, collation, pinning); loader
    worker processes end with the worker that started them (:class:`EndWithParent`)."""
    kwargs = {name: getattr(user_loader, name) for name in _CARRIED_ARGS if hasattr(user_loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
    elif _forks(kwargs.get("multiprocessing_context")):
        kwargs["worker_init_fn"] = EndWithParent(kwargs.get("worker_init_fn"))
    return kwargs


def _forks(context: Any) -> bool:
    """Whether loader workers are forked from the training process itself (torch's default on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    if context is None:
        import multiprocessing

        return multiprocessing.get_start_method(allow_none=True) in (None, "fork")
    name = context if isinstance(context, str) else getattr(context, "_name", None)
    return name == "fork"


class EndWithParent:
    """A loader worker's ``worker_init_fn`` (then the user's): the worker is SIGKILLed when the process that forked it
    dies. torch's loader worker ends when its parent is gone only if the parent was alive when the worker's watchdog
    started (after ``worker_init_fn``): a training worker SIGKILLed while it forked its loader workers (a fault, a
    rebuilt iterator) left them running for ever, holding the job's output open (`elan run | tee` never ended)."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init
        self.parent_pid = os.getpid()
        self.main_thread_forks = True  # set where the iterator is made: a fork from another thread is left alone

    def __call__(self, worker_id: int) -> None:
        if self.main_thread_forks and _die_with_parent():
            if os.getppid() != self.parent_pid:  # it died before the line above: nothing would signal this process
                os._exit(0)
        if self.user_init is not None:
            self.user_init(worker_id)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``: whether it took."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ElasticDataLoader:
    """Wraps the user's training DataLoader: same dataset and workers, batches cut from the serial position."""

    def __init__(self, user_loader: DataLoader, data: DataPosition, world: WorldView, seed: int) -> None:
        if user_loader.batch_size is None:
            raise ValueError("lightning_elan needs a DataLoader built with `batch_size` (no custom `batch_sampler`).")
        self.dataset = user_loader.dataset
        self.batch_size = user_loader.batch_size
        order = EpochOrder.from_sampler(user_loader.sampler, len(self.dataset), seed)
        self.sampler = ElasticSampler(order, data, drop_last=user_loader.drop_last)
        self.batch_sampler = ElasticBatchSampler(self.sampler, world)
        self._loader = DataLoader(self.dataset, batch_sampler=self.batch_sampler, **carried_arguments(user_loader))
        self._active: _ElasticIterator | None = None

    def __iter__(self) -> Iterator[Any]:
        self._active = _ElasticIterator(self._loader, draws_seed=self.sampler.data.position == 0)
        return self._active

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def rebuild(self) -> None:
        """Drop batches prefetched for the old world; continue from the current position."""
        if self._active is not None:
            self._active.restart()

    def state_dict(self) -> dict:
        return self.sampler.data.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.data.load_state_dict(state)


class _ElasticIterator:
    """Creates the torch iterator lazily, so it starts from the position current at the first ``next``.

    torch's iterator draws its base seed from the loader's generator (the global one where the loader has none) when it
    is made (``_BaseDataLoaderIter.__init__``): a static run draws once per epoch, at its start. An iterator made
    later in the epoch (rebuilt after a resize or a death, a joiner's first) keeps that generator's state, so the
    job's random streams, and what depends on them (a user's ``SubsetRandomSampler`` without a generator drew another
    order for the next epoch), are the static run's."""

    def __init__(self, loader: DataLoader, draws_seed: bool = True) -> None:
        self._loader = loader
        self._inner: Iterator[Any] | None = None
        self._draws_seed = draws_seed

    def __iter__(self) -> _ElasticIterator:
        return self

    def __next__(self) -> Any:
        if self._inner is None:
            init = self._loader.worker_init_fn
            if isinstance(init, EndWithParent):  # PR_SET_PDEATHSIG follows the forking thread: the main one only
                init.main_thread_forks = threading.current_thread() is threading.main_thread()
            self._inner = iter(self._loader) if self._draws_seed else _iterator_keeping_seed(self._loader)
        return next(self._inner)

    def restart(self) -> None:
        self._inner = None
        self._draws_seed = False


def _iterator_keeping_seed(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)`` with the generator it draws its base seed from put back as it was."""
    generator = loader.generator
    state = torch.random.get_rng_state() if generator is None else generator.get_state()
    try:
        return iter(loader)
    finally:
        if generator is None:
            torch.random.set_rng_state(state)
        else:
            generator.set_state(state)
