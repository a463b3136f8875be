"""Tests that share this machine's cores, and tests that need them alone (``pytest -n``, pytest-xdist).

Most tests spend much of their time waiting (workers warming up, a schedule's step, a signal's delivery) and run side
by side. A test marked ``solo`` measures time or throughput (a benchmark's pause, an autoscaler's throughput, a storm
of kills at a pace): it runs with no other test beside it. The rule is a readers-writer lock on two files every
xdist worker of one run sees: each test holds ``run.lock`` shared, a ``solo`` test holds it exclusively; both pass
through ``turnstile.lock`` first, so a ``solo`` test waiting for its turn is not starved by tests that keep starting.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path


@contextmanager
def cores(lock_dir: Path, alone: bool) -> Iterator[None]:
    """Hold the machine's cores shared with other tests, or ``alone``, for the ``with`` block."""
    with ExitStack() as held:
        turnstile = held.enter_context(_locked(lock_dir / "turnstile.lock", fcntl.LOCK_EX))
        held.enter_context(_locked(lock_dir / "run.lock", fcntl.LOCK_EX if alone else fcntl.LOCK_SH))
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # let the next test, solo or not, queue up behind this one
        yield


@contextmanager
def _locked(path: Path, operation: int) -> Iterator[int]:
    with open(path, "a") as descriptor:  # closing it releases the lock
        fcntl.flock(descriptor, operation)
        yield descriptor.fileno()
