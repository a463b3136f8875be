"""Children that die with the process that started them: ``prctl(PR_SET_PDEATHSIG)``, set between fork and exec.

On Linux a child learns nothing when its parent dies unless it asked to. Every process ``elan run`` and ``elan worker``
start asks, in a ``preexec_fn`` (it runs in the child after ``fork``, before ``exec``; the setting survives ``exec``):

* ``elan run``'s workers (members, joiners, standbys) for SIGKILL: the job's rendezvous store lives in the launcher,
  so without it the job cannot go on, and nobody would be left to stop them;
* the AM ``elan run`` starts for SIGTERM: it stops as on Ctrl-C (its registry entry is removed, its state stays in the
  state directory); its ``--parent-pid`` watch is the fallback;
* ``elan worker``'s training command for SIGTERM: its job goes on without it (the AM and the store are elsewhere),
  so the command leaves it gracefully, or takes the crash path ``--term-grace`` seconds later.

The kernel sends the signal when the *thread* that forked the child ends, not the process: children are started only
from the thread that runs the launcher to its end (the main thread of ``elan run``/``elan worker``). A parent that died
between the fork and the ``prctl`` is caught by comparing ``getppid`` with the parent's pid right after it. The
``preexec_fn`` takes no lock and does not log (the child of a threaded parent must not). Elsewhere than Linux there is
no ``preexec_fn`` and nothing changes. Only the direct child is covered: a command that is a wrapper (``sh -c …``)
passes nothing on to its own children.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["die_with_parent"]

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    """libc's ``prctl`` (None elsewhere than Linux, or when it cannot be found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("prctl not found: children do not die with their launcher", exc_info=True)
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when the calling thread ends (None where
    unsupported). A child whose parent is already gone exits at once with ``128 + signum``."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()
    number = int(signum)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(128 + number)

    return preexec
