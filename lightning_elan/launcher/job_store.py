"""The rendezvous store of an ``elan run`` job, as the launcher holds it: a torch ``TCPStore`` server (the joiners'
rendezvous, the workers' marks, the failure keys) that lives exactly as long as the launcher.

Where it runs: in the *store host*, a process the preload process forks once its imports are done
(``preload_site/sitecustomize.py``; torch is imported there already), so the launcher never imports torch itself — 2.4
CPU-seconds per ``elan run`` on the 2-core development machine, a fifth of a short job's CPU. Without a preload process
(``--no-preload``, a command it cannot start, one whose imports it refused) the store runs in the launcher, as before.
Either way the launcher reads the workers' marks (:meth:`JobStore.check`) and sets failure keys (:meth:`JobStore.set`)
on it. The store host ends when the launcher closes its channel or dies (the pipe's end of file); if it dies first the
job cannot go on: :class:`StoreLost`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import time
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["ForkedStore", "JobStore", "LauncherStore", "StoreLost"]


class StoreLost(RuntimeError):
    """The store host is gone (or answered with an error): the job's workers have no rendezvous store any more."""


class JobStore(Protocol):
    """What the launcher does with the job's store."""

    @property
    def port(self) -> int: ...

    def check(self, keys: Sequence[str]) -> bool: ...

    def set(self, key: str, value: str) -> None: ...

    def close(self) -> None: ...


class LauncherStore:
    """The store served by the launcher itself (it imports torch for it)."""

    def __init__(self, host: str) -> None:
        from torch.distributed import TCPStore

        self._store: Any = TCPStore(host, 0, is_master=True, wait_for_workers=False)

    @property
    def port(self) -> int:
        return int(self._store.port)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def close(self) -> None:
        self._store = None  # the TCPStore server shuts down with its last reference


class ForkedStore:
    """The launcher's side of the store host: one JSON line each way per call, over two pipes it owns."""

    def __init__(self, request_fd: int, reply_fd: int, timeout_s: float = 30.0) -> None:
        self._request_fd = request_fd
        self._reply_fd = reply_fd
        self._buffer = b""
        self._timeout_s = timeout_s
        self._port = int(self._reply()["port"])  # the host says it once its TCPStore listens
        log.debug("the job's store is served by the store host on port %d", self._port)

    @property
    def port(self) -> int:
        return self._port

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)}))

    def set(self, key: str, value: str) -> None:
        self._call({"op": "set", "key": key, "value": value})

    def close(self) -> None:
        """Close the channel: the store host ends."""
        for fd in (self._request_fd, self._reply_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._request_fd = self._reply_fd = -1

    def _call(self, request: dict[str, Any]) -> Any:
        try:
            os.write(self._request_fd, json.dumps(request).encode() + b"\n")
        except OSError as exc:
            raise StoreLost(f"the job's rendezvous store host is gone ({exc})") from exc
        reply = self._reply()
        if "error" in reply:
            raise StoreLost(f"the job's rendezvous store failed: {reply['error']}")
        return reply.get("result")

    def _reply(self) -> dict[str, Any]:
        """The next line the host writes, within the timeout."""
        deadline = time.monotonic() + self._timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if self._reply_fd < 0 or left <= 0 or not select.select([self._reply_fd], [], [], left)[0]:
                raise StoreLost(f"the job's rendezvous store host did not answer within {self._timeout_s:.0f} s")
            data = os.read(self._reply_fd, 1 << 16)
            if not data:
                raise StoreLost("the job's rendezvous store host is gone (its channel closed)")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)
