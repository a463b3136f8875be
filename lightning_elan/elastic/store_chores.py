"""Writes to the job's store that no training step waits for, done in order on one background thread.

A member's bookkeeping in the job's store — rank 0's notice of the state a joiner will receive
(:mod:`~lightning_elan.elastic.state_size`), the deletion of a finished generation's keys, the mark that the training
loop started — must not stall training: with the store in etcd, an outage of etcd would hold the step for as long as
the store retries (the steps themselves go on: their commit votes are in the generation's own store). A chore that
fails is logged and dropped; the next one runs. The store's clients are safe across threads (``TCPStore`` serialises
its calls, an etcd store keeps a connection per thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["StoreChores"]


class StoreChores:
    """A queue of store writes, run in submission order by a daemon thread started on the first one."""

    def __init__(self) -> None:
        self._pending: deque[tuple[str, Callable[[], object]]] = deque()
        self._changed = threading.Condition()
        self._running = False  # a chore taken off the queue and not finished
        self._thread: threading.Thread | None = None

    def submit(self, what: str, chore: Callable[[], object]) -> None:
        """Queue ``chore`` (``what`` names it in the log); returns at once."""
        with self._changed:
            self._pending.append((what, chore))
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elan-store-chores", daemon=True)
                self._thread.start()

    @property
    def pending(self) -> int:
        """Chores queued or under way."""
        with self._changed:
            return len(self._pending) + self._running

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued chore to finish; whether they did (the rest stay queued)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._pending or self._running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.info("%d store write(s) not done after %.1f s (the store does not answer); left behind",
                             len(self._pending) + self._running, timeout_s)
                    return False
                self._changed.wait(remaining)
        return True

    def _run(self) -> None:
        while True:
            what, chore = self._take()
            try:
                chore()
            except Exception as error:  # bookkeeping: a failed write is logged, training goes on
                log.warning("store write dropped (%s): %s", what, error)
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()

    def _take(self) -> tuple[str, Callable[[], object]]:
        with self._changed:
            while not self._pending:
                self._changed.wait()
            self._running = True
            return self._pending.popleft()
