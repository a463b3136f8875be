"""One process of a job at a time on a host: a mutex named by the job, held by binding an abstract Unix socket.

Lightning runs ``prepare_data`` once per node, on its local rank 0, and expects no other process of the job on that
node to run it meanwhile. An elastic job breaks that: a joiner started while the members launch (a request queued at
launch, a replacement, a standby) runs the user's script from its top as local rank 0 of its own provisional world, so
on a host that holds a member it ran ``prepare_data`` while the member's rank 0 ran it too — two downloads into one
temporary path, one of them failing (found by probe round 9). :class:`HostMutex` makes them take turns. The socket's
name lives in the host's (network namespace's) abstract namespace: nothing is written to disk, and it is released when
its holder closes it or dies (a SIGKILLed holder cannot leave it held).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import socket
import time
from types import TracebackType

log = logging.getLogger(__name__)

__all__ = ["HostMutex"]

POLL_S = 0.05


class HostMutex:
    """``with HostMutex(name):`` — the block runs in one process of this host at a time (Linux); elsewhere, or where
    an abstract socket cannot be made, it runs without waiting."""

    def __init__(self, name: str, what: str = "") -> None:
        digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:24]
        self.address = f"\0elan-mutex-{digest}"
        self.what = what or name
        self._socket: socket.socket | None = None

    def __enter__(self) -> HostMutex:
        waited = False
        while True:
            held = self._try_acquire()
            if held is not False:
                break
            if not waited:
                log.info("waiting for another process of this host to finish %s", self.what)
                waited = True
            time.sleep(POLL_S)
        return self

    def _try_acquire(self) -> bool | None:
        """True: held; False: another process holds it; None: no such mutex here (the block runs unguarded)."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except (AttributeError, OSError):
            return None
        try:
            sock.bind(self.address)
        except OSError as error:
            sock.close()
            return False if error.errno == errno.EADDRINUSE else None  # held by another process
        self._socket = sock
        return True

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
