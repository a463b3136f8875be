"""How much state a joiner will receive beyond its own model, told ahead through the job's store.

Rank 0 publishes the bytes of its training state's tensors a joiner has no tensor of its own for (optimizer moments
and the like: :meth:`~lightning_elan.elastic.frontend.FrontEnd.state_nbytes_beyond_model`) at its generation's first
coordination (again while that is still 0: an optimizer's state appears at its first step). A joiner on the CPU reads
it when it reports ready (or as soon as it is there) and faults that much memory in while it waits for its adjustment
(:class:`~lightning_elan.replication.reception.PrefaultedMemory`): its state then lands in memory it touched before the
stayers began to wait, not page by page during the pause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from lightning_elan.elastic.store_chores import StoreChores
from lightning_elan.replication.reception import PrefaultedMemory

log = logging.getLogger(__name__)

__all__ = ["STATE_NBYTES_KEY", "StateSizeNotice", "fault_in_for_joiner"]

STATE_NBYTES_KEY = "elan/state-nbytes-beyond-model"


class StateSizeNotice:
    """Rank 0's side: publish the size once per generation (until it is non-zero)."""

    def __init__(self) -> None:
        self._published: int | None = None

    def new_generation(self) -> None:
        self._published = None

    def publish_if_due(self, store: dist.Store, measure: Callable[[], int], chores: StoreChores) -> None:
        """Publish ``measure()`` unless a non-zero size was published in this generation (the write off the training
        thread: a store that does not answer must not hold the step)."""
        if self._published:
            return
        nbytes = max(0, int(measure()))
        if nbytes != self._published:
            chores.submit("the state size a joiner receives", lambda: _publish(store, nbytes))
        self._published = nbytes


def _publish(store: dist.Store, nbytes: int) -> None:
    store.set(STATE_NBYTES_KEY, str(nbytes))
    log.debug("published the state beyond the model: %d bytes", nbytes)


def fault_in_for_joiner(store: dist.Store) -> PrefaultedMemory:
    """A joiner: fault in room for the state rank 0 published, in the background; if nothing is published yet (the
    joiner started with the job), as soon as it is."""
    return PrefaultedMemory(lambda: _published(store), poll_s=0.5)


def _published(store: dist.Store) -> int | None:
    if not store.check([STATE_NBYTES_KEY]):
        return None
    nbytes = int(store.get(STATE_NBYTES_KEY))
    return nbytes if nbytes > 0 else None
