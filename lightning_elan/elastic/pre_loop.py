"""Collectives a front-end makes outside its training batches — until its first training batch (Lightning's barriers
around ``prepare_data`` and ``setup``, ``ModelCheckpoint``'s directory broadcast, the sanity check's reductions, the
``on_train_start`` and first ``on_train_epoch_start`` hooks) and, in the loop, from a batch's standing to the next
batch's start or the loop's end (the ``on_train_batch_end`` hooks, the epoch's end and the next one's start, the
``on_train_end`` hooks: the ``Timer``'s broadcast of its stop decision after every batch, ``ModelCheckpoint``'s
broadcasts; a front-end keeps out what must run its hook again instead, as Lightning's reductions and its checkpoint
save's barrier): a member's death in one is recovered from and the job goes on.

Members can be one collective apart when a death hits: a broadcast's source (or a barrier's root) may complete it
while a receiver learns of the death inside it, so the source is already in the next collective, or in the training
loop. Every collective made there is kept in order with the inputs it was given; after each recovery while they are
kept, every survivor says how far it got (its *position*: the collective it is in, or how many it completed) and all
go back to the earliest one: those ahead run again, with the same inputs, what the others have not completed. So every
survivor runs the same sequence of collectives in the new generation, and the one that failed runs again. A survivor
already at the batch boundary, or in the next batch, replays before it goes on (its interrupted batch is redone).
A training batch's own collectives are not kept: a death in them redoes the batch.

Pure logic: the collectives, the recovery and the agreement on the earliest position are given as callables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["PreLoopCollectives"]


class PreLoopCollectives:
    """The collectives made outside the training batches (before the loop; from a batch's standing to the next batch's
    start), replayed after a recovery while they are kept.

    ``recover(error)`` returns once the job re-formed without a dead member (it re-raises ``error`` when no member
    died); ``earliest(position)`` publishes this member's position in the new generation and returns the earliest of
    every survivor's (``earliest(None)``: this member publishes that it has none and returns None at once).
    """

    def __init__(self, recover: Callable[[BaseException], None],
                 earliest: Callable[[int | None], int | None]) -> None:
        self._recover = recover
        self._earliest = earliest
        self._calls: list[Callable[[], Any]] = []
        self._recording = True  # until the first batch starts, and from a batch's standing until the next one starts
        self._open = True  # until a step is committed (and again once its batch stands): survivors may be apart
        self._joined = False  # the state was replicated into this process: it made no collective of the others'
        self._in_loop = False

    @property
    def before_loop(self) -> bool:
        """Whether the training loop has not started yet."""
        return not self._in_loop

    def run(self, collective: Callable[[], Any]) -> Any:
        """Run ``collective`` (a call that can run again with the same inputs); while collectives are kept, recover from
        a member's death and run it again in the new generation."""
        if not self._recording:
            return collective()
        self._calls.append(collective)
        return self._run_from(len(self._calls) - 1)

    def loop_started(self) -> None:
        """The training loop began: the collectives until its first batch starts (the loop's and the first epoch's
        start hooks) are kept with those before it; from then on a batch's collectives are its own to redo."""
        self._in_loop = True

    def batch_stood(self) -> None:
        """A training batch stands (its last step committed): the collectives until the next batch starts are kept
        afresh, for survivors a death finds apart in them."""
        self._calls.clear()
        self._recording = self._open = True
        self._joined = False

    def batch_started(self) -> None:
        """A training batch starts: its collectives are its own to redo; those kept since the last batch stood stay
        until its step is committed (a survivor may still be behind in them)."""
        if self._in_loop:
            self._recording = False

    def loop_ended(self) -> None:
        """The training loop is over: nothing is kept any more."""
        self._recording = self._open = False
        self._calls.clear()

    def step_committed(self) -> None:
        """Every member committed a step: every survivor of a later death is past the collectives kept here."""
        self._open = False
        self._calls.clear()

    def joined(self) -> None:
        """This process received the training state from a member (a joiner): the others' collectives before the loop
        are none of its business, but until a step is committed it tells the other survivors of a recovery so."""
        self._joined = True
        self._calls.clear()

    def catch_up(self) -> None:
        """After a recovery in the training loop, while collectives are kept (no step committed yet, or since the last
        batch stood): run again, with the survivors behind, the collectives they had not completed."""
        if not self._open:
            return
        if self._joined:
            self._earliest(None)
            return
        earliest = self._earliest(len(self._calls))
        assert earliest is not None
        self._run_from(earliest)

    def _run_from(self, position: int) -> Any:
        result = None
        while position < len(self._calls):
            try:
                result = self._calls[position]()
                position += 1
            except Exception as error:
                self._recover(error)
                earliest = self._earliest(position)
                assert earliest is not None
                if earliest < position:
                    log.warning("a survivor was %d collective(s) behind when a member died before the training loop: "
                                "running them again with it", position - earliest)
                position = earliest
        return result
