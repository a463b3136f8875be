"""Children that die with the process that started them: ``prctl(PR_SET_PDEATHSIG)``, set between fork and exec.

On Linux a child learns nothing when its parent dies unless it asked to. Every process ``elan run`` and ``elan worker``
start asks, in a ``preexec_fn`` (it runs in the child after ``fork``, before ``exec``; the setting survives ``exec``):

* ``elan run``'s workers (members, joiners, standbys) for SIGKILL: the job's rendezvous store lives as long as the
  launcher, so without it the job cannot go on, and nobody would be left to stop them;
* the AM ``elan run`` starts for SIGTERM: it stops as on Ctrl-C (its registry entry is removed, its state stays in the
  state directory); its ``--parent-pid`` watch is the fallback. It too starts with SIGTERM held (below), until
  ``elan am`` has installed its handler, before it binds and registers;
* ``elan worker``'s training command for SIGTERM: its job goes on without it (the AM and the store are elsewhere),
  so the command leaves it gracefully, or takes the crash path ``--term-grace`` seconds later (a command still
  starting takes it once its SIGTERM watch is installed, below; one that never installs it is not stopped).

The kernel sends the signal when the *thread* that forked the child ends, not the process: children are started only
from the thread that runs the launcher to its end (the main thread of ``elan run``/``elan worker``). A parent that died
between the fork and the ``prctl`` is caught by comparing ``getppid`` with the parent's pid right after it. The
``preexec_fn`` takes no lock and does not log (the child of a threaded parent must not). Elsewhere than Linux there is
no ``preexec_fn`` and nothing changes. Only the direct child is covered: a command that is a wrapper (``sh -c …``)
passes nothing on to its own children.

The same ``preexec_fn`` starts every worker (``hold_sigterm``) with SIGTERM *blocked* in its signal mask: a blocked
signal stays pending across ``exec``, so a SIGTERM that comes while the worker imports torch and Lightning (before it
has a handler) waits instead of killing it, and the worker's SIGTERM watch (``elastic/termination.py``) unblocks it
right after installing its handler: a SIGTERM during start-up is a leave, not a crash. A command that never starts
the elan engine keeps SIGTERM blocked; :func:`sigterm_held` is the backstop: ``elan run`` and ``elan worker`` read
each child's pending and blocked signals (``/proc/PID/status``) and SIGKILL one whose SIGTERM has waited
``--term-grace`` seconds, what the watch's crash path would have done (at once when they sent it themselves to stop
the child).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["die_with_parent", "sigterm_held"]

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


def die_with_parent(signum: int = signal.SIGKILL, *, hold_sigterm: bool = False) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when the calling thread ends (None where
    unsupported). A child whose parent is already gone exits at once with ``128 + signum``. With ``hold_sigterm`` the
    child starts with SIGTERM blocked (a worker: its SIGTERM watch unblocks it once its handler is installed)."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()
    number = int(signum)
    held = {signal.SIGTERM} if hold_sigterm else set()

    def preexec() -> None:
        if held:
            signal.pthread_sigmask(signal.SIG_BLOCK, held)
        prctl(PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(128 + number)

    return preexec


def sigterm_held(pid: int) -> bool:
    """Whether process ``pid`` holds a SIGTERM: one is pending and its main thread blocks it (False when the process is
    gone, or elsewhere than Linux). A pending SIGTERM the main thread does not block is on its way to the handler."""
    masks = _signal_masks(pid)
    bit = 1 << (signal.SIGTERM - 1)
    return bool((masks.get("ShdPnd", 0) | masks.get("SigPnd", 0)) & masks.get("SigBlk", 0) & bit)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (``T`` in ``/proc/PID/stat``: SIGSTOP, SIGTSTP; not a
    debugger's tracing stop ``t``). False when it is gone or the state cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _signal_masks(pid: int) -> dict[str, int]:
    """The signal masks of ``/proc/PID/status`` (``SigBlk``, ``ShdPnd``, ...) by name; empty when it cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if line.startswith(("Sig", "Shd")))
    return {name: int(value.strip(), 16) for name, value in fields if name in ("ShdPnd", "SigPnd", "SigBlk")}
