"""Which ``elan worker``s the AM has stopped hearing from: a host lost, powered off, paused or cut off the network.

An ``elan worker`` asks the AM ``worker_poll`` every few seconds while its command runs (``launcher/enrolled.py``).
A host that vanishes sends nothing more: no exit is reported and no connection is reset, so its peers would wait in
their collective until its timeout (``ElanStrategy(timeout=…)``, 300 s by default), then the frozen-member path. The
AM keeps, per worker it watches, when it last heard from its ``elan worker`` (a ``worker_poll``, an ``enrol``, a
``worker_exit``); one silent for the job's ``heartbeat_timeout_s`` is *lost*: the AM takes it for dead
(``recovering.worker_lost``) and announces the failure in the rendezvous store, which releases the others'
collectives at once.

Watched: the workers of a started, unfinished job of ``elan worker``s whose training is not over — the members, the
joiners of the plan in flight, the survivors being recovered and the joiners warming up (not the workers an ``elan
scale add`` asked the scheduler for: no ``elan worker`` runs for them yet) — less those that exited, left or were
declared dead. A worker this AM process has not heard from yet (it just started, or took over from another) counts
from the moment it is first watched. The AM's own stalls do not count against the workers: when its clock moved on
by more than :data:`AM_STALL_S` between two looks (the AM was stopped, swapped out, or blocked on its store), every
time heard is moved on by as much (not past the present: a poll read right after the stall counts from then). Nor
its own network's: when no watched worker at all has been heard from for :data:`DEAF_S` the AM is *deaf* — its own
host cut off is likelier than every other host failing at once, and declaring them all dead would end a job that
only lost its AM's network a while (its members wait for the AM at their next coordination point and go on once it
is back) — and nobody is lost until it hears again; then every watched worker's clock restarts (their polls come back
one by one: the first must not make the others look lost). Pure bookkeeping: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_elan.master.state import READY, SPAWNED, JobState

STARTED = (SPAWNED, READY)
"""A joiner with an ``elan worker`` (not one an ``elan scale add`` asked the scheduler for, still to come)."""
AM_STALL_S = 5.0
"""A gap this long between two looks is the AM's own stall, not its workers' silence."""
DEAF_S = 7.0
"""No watched worker heard from this long (each polls every 5 s, a poll may take 1.5 s more): the AM's own network is
out, not every host at once. ``MIN_HEARTBEAT_TIMEOUT_S`` leaves room for it: a worker that polled last 6.5 s before
the cut is silent for less than its timeout when the AM finds itself deaf."""


def watched_workers(state: JobState) -> list[str]:
    """The workers whose ``elan worker`` must keep polling (see the module docstring)."""
    if state.enrolment is None or not state.started or state.finished or state.training_over():
        return []
    workers = dict.fromkeys(state.member_ids)
    if state.in_flight is not None:
        workers.update(dict.fromkeys(state.in_flight.plan.members))
    if state.recovery is not None:
        workers.update(dict.fromkeys(state.recovery.survivors))
    workers.update(dict.fromkeys(w for w, pending in state.pending_workers.items() if pending.status in STARTED))
    gone = set(state.exits) | set(state.declared_dead) | set(state.left_workers)
    return [worker for worker in workers if worker not in gone]


class Heartbeats:
    """When the AM last heard from each ``elan worker`` (monotonic seconds), and which went silent too long."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deaf = False  # no watched worker heard from for DEAF_S: the AM's own network is out
        self._heard: dict[str, float] = {}
        self._looked_at: float | None = None

    def heard(self, worker_id: str, now: float) -> None:
        self._heard[worker_id] = now

    def silent(self, watched: Iterable[str], now: float) -> dict[str, float]:
        """The watched workers not heard from for ``timeout_s``, with how long they have been silent; none while the
        AM is deaf, nor at the look that ends it (see the module docstring)."""
        self._forgive_own_stall(now)
        heard = {worker: self._heard.setdefault(worker, now) for worker in watched}
        if self._deaf_now(heard, now):
            return {}
        return {worker: now - last for worker, last in heard.items() if now - last >= self.timeout_s}

    def _deaf_now(self, heard: dict[str, float], now: float) -> bool:
        """Whether nobody was heard from for ``DEAF_S`` (then, or at the first look after, every clock restarts)."""
        was_deaf, self.deaf = self.deaf, bool(heard) and now - max(heard.values()) >= DEAF_S
        if was_deaf and not self.deaf:  # heard again: each gets a whole timeout from now
            self._heard.update(dict.fromkeys(heard, now))
        return was_deaf or self.deaf

    def forget(self, worker_id: str) -> None:
        self._heard.pop(worker_id, None)

    def _forgive_own_stall(self, now: float) -> None:
        gap = 0.0 if self._looked_at is None else now - self._looked_at
        self._looked_at = now
        if gap > AM_STALL_S:
            self._heard = {worker: min(heard + gap, now) for worker, heard in self._heard.items()}
