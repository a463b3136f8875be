"""The tracker rows ``accelerator.log`` sends, written once even when the main process dies before it wrote them.

Only the main process writes to the trackers. Every member counts the ``log`` calls of the training (the same count
on every member: a joiner receives it with the state) and keeps the latest rows; the main process marks each row it
wrote in the generation's vote store (``elastic/logged_rows.py``). At a recovery from the death of the main process,
the new main process (whose trackers start then) writes again the rows its predecessor had not marked: those it
died before writing (a SIGKILL just before an epoch's ``accelerator.log``, or before an applied step's row).

A row logged in a step that is then discarded (a member died during it: the survivors train it again) is forgotten
with the step, and a row logged on a process after its step was cut short is not kept (that step's redo logs it).
Values a process computed alone (a loss that is not reduced) are the new main process's own in a row it writes again.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["TrackerRows"]

WriteRow = Callable[[dict[str, Any], int | None, dict[str, Any] | None], None]
"""Accelerate's ``log(values, step, log_kwargs)`` on the main process."""

KEPT_ROWS = 256
"""The newest rows every process keeps (a main process dies in the code between two collectives, so only the rows
logged since the last one can be missing)."""


@dataclass(frozen=True)
class _Row:
    number: int
    values: dict[str, Any]
    step: int | None
    log_kwargs: dict[str, Any] | None


class TrackerRows:
    """One process's count of ``log`` calls and its newest rows."""

    def __init__(self) -> None:
        self.count = 0
        self._kept: deque[_Row] = deque(maxlen=KEPT_ROWS)

    def logged(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None) -> int:
        """A row is logged: keep a copy; returns its number."""
        self.count += 1
        self._kept.append(_Row(self.count, copy.deepcopy(dict(values)), step, copy.deepcopy(log_kwargs)))
        return self.count

    def forget_after(self, count: int) -> None:
        """The step that logged the rows after ``count`` is discarded: its redo logs them again."""
        while self._kept and self._kept[-1].number > count:
            self._kept.pop()
        self.count = min(self.count, count)

    def write_again(self, after: int, upto: int, write: WriteRow) -> int:
        """Write the kept rows numbered ``after`` < n <= ``upto``; returns how many."""
        rows = [row for row in self._kept if after < row.number <= upto]
        if rows and rows[0].number != after + 1:
            log.warning("tracker rows %d to %d were logged before this process's kept rows: they are missing",
                        after + 1, rows[0].number - 1)
        for row in rows:
            write(row.values, row.step, row.log_kwargs)
        return len(rows)
