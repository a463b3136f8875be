"""A DataLoader stand-in whose iterator can be rebuilt from the data position after a resize."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

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
    """The user's DataLoader arguments a loader that forms its own batches keeps (workers, collation, pinning)."""
    kwargs = {name: getattr(user_loader, name) for name in _CARRIED_ARGS if hasattr(user_loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
    return kwargs


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
        self._active = _ElasticIterator(self._loader)
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
    """Creates the torch iterator lazily, so it starts from the position current at the first ``next``."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._inner: Iterator[Any] | None = None

    def __iter__(self) -> _ElasticIterator:
        return self

    def __next__(self) -> Any:
        if self._inner is None:
            self._inner = iter(self._loader)
        return next(self._inner)

    def restart(self) -> None:
        self._inner = None
