"""The logger rows of a step that stood, written once even when rank 0 dies before it wrote them.

A front-end holds what a step sends to its loggers until the step stands (a discarded step logs nothing), and only
rank 0's loggers write. Every member keeps the rows of the last step that stood (its *closed window*), and rank 0,
once it wrote and saved them, marks that window in the generation's vote store (``elan/gen<g>/logged_rows``). At a
recovery, the new rank 0 re-sends the rows of a window closed in the failed generation that its rank 0 had not
marked: it died after the step stood and before its loggers had the rows. Windows are told apart by a number that
grows with every batch (the same on every member); only windows with rows are marked (no store write otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["LoggedRows", "rows_key"]


def rows_key(generation: int) -> str:
    """Where rank 0 of ``generation`` marks the last window whose rows it wrote."""
    return f"elan/gen{generation}/logged_rows"


@dataclass(frozen=True)
class _Closed:
    window: int
    generation: int


class LoggedRows:
    """One worker's side: its last closed window with rows, rank 0's mark of it, and the heir's re-send."""

    def __init__(self) -> None:
        self._resend: Callable[[int], bool] | None = None
        self._closed: _Closed | None = None
        self._unwritten: int | None = None
        self._marked: int = 0  # the window the failed generation's rank 0 marked last (0: none)

    def follow(self, resend: Callable[[int], bool]) -> None:
        """``resend(window)`` logs and saves the rows of ``window`` again; False when this process has none of it."""
        self._resend = resend

    def closed(self, store: dist.Store, generation: int, rank: int, window: int) -> None:
        """A window with rows closed (rank 0 wrote and saved them): remember it; rank 0 marks it."""
        self._closed = _Closed(window, generation)
        if rank != 0:
            return
        try:
            store.set(rows_key(generation), str(window))
        except (RuntimeError, OSError) as error:  # the store is the job's (or rank 0's own): training goes on
            log.warning("rank 0 could not mark the logger rows of its last step as written (%s): should it die before "
                        "its next step, the new rank 0 writes them again", error)

    def check(self, store: dist.Store | None, failed: int) -> None:
        """At a recovery from ``failed``, before its vote store goes: whether its rank 0 wrote the last closed rows (a
        re-send still due from a recovery cut short stays due)."""
        closed = self._closed
        if closed is None or closed.generation != failed or store is None:
            return  # closed in an earlier generation: written then, or re-sent at the recovery from it
        try:
            marked = _marked(store, failed)
        except (RuntimeError, OSError, ValueError) as error:  # an etcd job's vote store died with rank 0's host
            log.warning("could not tell whether rank 0 wrote the logger rows of the last step before generation %d "
                        "failed (%s): if it died before, they are missing", failed, error)
            return
        if marked is None or marked < closed.window:
            self._unwritten, self._marked = closed.window, marked or 0

    @property
    def marked(self) -> int:
        """During a re-send: the last window the dead rank 0 marked as written (0: none), so a front-end whose windows
        are numbered one by one (Accelerate's tracker rows) writes every later one."""
        return self._marked

    def resend_if_due(self, store: dist.Store | None, generation: int, rank: int) -> None:
        """After the recovery: the new rank 0 writes the rows its dead predecessor had not, and marks them."""
        window, self._unwritten = self._unwritten, None
        if window is None or rank != 0 or self._resend is None:
            return
        if not self._resend(window):
            return
        log.warning("rank 0 died after the last step stood, before its loggers had that step's rows: the new rank 0 "
                    "wrote them (values logged without sync_dist are its own)")
        if store is not None:
            self.closed(store, generation, rank, window)


def _marked(store: dist.Store, generation: int) -> int | None:
    """The window rank 0 of ``generation`` marked last (None: none)."""
    key = rows_key(generation)
    return int(store.get(key)) if store.check([key]) else None
