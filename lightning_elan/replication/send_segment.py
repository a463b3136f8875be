"""A source's shared-memory segment, made before it is needed and kept for the next adjustment.

The first write into a tmpfs segment allocates its pages, and on a VM that costs far more than writing into pages that
exist (the 2-core development VM, a 25 M model's 309 MB in whole jobs at load 9–17: 0.30–1.56 s into a new file,
0.15–0.34 s into one written before; docs/benchmarks.md). Done inside an adjustment, that is the stayers' pause.
:class:`SendSegment` lets a worker that may serve as a source make its segment ahead of time: a thread creates the
file and writes zeros over it (in :data:`CHUNK` pieces, paced to :data:`DUTY` of one core so the training step is not
slowed), and the shared-memory transport writes into it instead of creating a file, then hands it back once every
reader has its copy instead of unlinking it. The engine prepares it while a request's joiners warm up and keeps it
while more are coming (``ELAN_SEND_AHEAD``, :mod:`lightning_elan.elastic.send_ahead`).

Memory: the segment holds the packed state's size of tmpfs (``$ELAN_SHM_DIR``; 12 bytes per parameter for float32
weights with Adam) from :meth:`SendSegment.prepare` until :meth:`SendSegment.release`. Readers must copy what they
read (the engine's readers do); a reader that maps the file (``ShmTransport(zero_copy=True)``) would see the next
adjustment's bytes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["CHUNK", "DUTY", "PreparedFile", "SendSegment"]

CHUNK = 8 << 20
"""Bytes of zeros the preparing thread writes at a time."""
DUTY = 0.25
"""The share of one core the preparing thread uses at most (it sleeps between chunks); a send that needs the segment
before it is ready hurries it (no more sleeping)."""


@dataclass
class PreparedFile:
    """A segment file open for reading and writing, ``nbytes`` of it allocated; :meth:`remove` unlinks and closes it
    (once; at the latest when the process exits)."""

    path: Path
    fd: int
    nbytes: int
    _finalizer: weakref.finalize = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _remove, self.path, self.fd)

    def linked(self) -> bool:
        """Whether the file is still in its directory (a stale-segment sweep may have removed it)."""
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def remove(self) -> None:
        """Unlink the file now; close it (which frees its pages, a while for hundreds of MB) in a thread, off the
        training thread."""
        if self._finalizer.detach() is not None:
            _unlink_if_ours(self.path, self.fd)
            threading.Thread(target=_close, args=(self.fd,), name="elan-send-segment-close", daemon=True).start()


class SendSegment:
    """The one segment a worker keeps for its sends: prepared in a thread, taken by a send, given back after it."""

    def __init__(self, directory: Path, duty: float = DUTY) -> None:
        self.directory = directory
        self._duty = duty
        self._lock = threading.Lock()
        self._file: PreparedFile | None = None
        self._thread: threading.Thread | None = None
        self._hurry = threading.Event()
        self._in_use = False
        self._released = False
        self._failed_at: int | None = None  # a preparation of this many bytes failed (a full tmpfs): not again

    @property
    def nbytes_held(self) -> int:
        """Bytes of tmpfs the segment holds, once prepared."""
        with self._lock:
            return 0 if self._file is None else self._file.nbytes

    def prepare(self, nbytes: int) -> None:
        """Have at least ``nbytes`` allocated soon: a thread creates or grows the segment (nothing to do if it is big
        enough, being prepared, or in use by a send)."""
        with self._lock:
            self._released = False
            if self._in_use or (self._thread is not None and self._thread.is_alive()):
                return
            if self._failed_at is not None and nbytes >= self._failed_at:
                return
            if self._file is not None and self._file.nbytes >= nbytes and self._file.linked():
                _touch(self._file)  # a sweep of stale segments goes by the modification time
                return
            self._hurry.clear()
            self._thread = threading.Thread(target=self._make, args=(nbytes,), name="elan-send-ahead", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Until the preparation under way (if any) has ended, at its own pace."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def take(self, nbytes: int) -> PreparedFile | None:
        """The prepared segment for a send of ``nbytes`` (its preparation hurried and awaited; grown if it is short),
        or None when there is none, it is in use, or it was removed."""
        self._hurry.set()
        self.wait()
        with self._lock:
            prepared = self._file
            if prepared is None or self._in_use:
                return None
            if not prepared.linked():
                self._drop_locked()
                return None
            if prepared.nbytes < nbytes:
                os.ftruncate(prepared.fd, nbytes)  # the rest is allocated as it is written
                prepared.nbytes = nbytes
            self._in_use = True
            return prepared

    def give_back(self, prepared: PreparedFile) -> None:
        """A send is done with the segment (every reader has its copy): keep it for the next, unless released."""
        with self._lock:
            if prepared is not self._file:
                return
            self._in_use = False
            if self._released:
                self._drop_locked()

    def discard(self, prepared: PreparedFile) -> None:
        """A send failed with the segment: remove it."""
        with self._lock:
            if prepared is self._file:
                self._in_use = False
                self._drop_locked()

    def release(self) -> None:
        """Remove the segment now, or when its preparation ends or the send that uses it gives it back."""
        self._hurry.set()
        with self._lock:
            self._released = True
            preparing = self._thread is not None and self._thread.is_alive()
            if not self._in_use and not preparing:
                self._drop_locked()

    def _make(self, nbytes: int) -> None:
        """The thread: a new file (or the kept one, grown), allocated chunk by chunk at the set duty."""
        started = time.perf_counter()
        with self._lock:
            prepared = self._file
        try:
            if prepared is None or not prepared.linked():
                prepared = self._create()
            begin = prepared.nbytes if prepared.nbytes <= nbytes else nbytes
            os.ftruncate(prepared.fd, max(nbytes, prepared.nbytes))
            self._allocate(prepared.fd, begin, nbytes)
        except OSError as error:  # a full or missing tmpfs: the send creates its segment as before
            log.warning("cannot prepare a %d-byte send segment in %s (%s): sends create theirs", nbytes,
                        self.directory, error)
            with self._lock:
                self._failed_at = nbytes
                self._drop_locked()
            return
        with self._lock:
            prepared.nbytes = max(nbytes, prepared.nbytes)
            self._file = prepared
            if self._released:
                self._drop_locked()
        log.debug("send segment %s: %d bytes allocated in %.0f ms", prepared.path, nbytes,
                  (time.perf_counter() - started) * 1e3)

    def _create(self) -> PreparedFile:
        path = self.directory / f"elan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        prepared = PreparedFile(path, os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), 0)
        with self._lock:
            self._file = prepared
        return prepared

    def _allocate(self, fd: int, begin: int, end: int) -> None:
        """Write zeros over ``[begin, end)`` and read them back: every page allocated, written and touched a second time
        (``posix_fallocate`` allocates tmpfs pages without writing them, and on the development VM the first write into
        such a page still costs what a write into a hole does: 570 ms for 309 MB against 170 ms into a segment written
        before; for the second touch see :func:`_touch_again`)."""
        zeros, readback = memoryview(bytes(CHUNK)), memoryview(bytearray(CHUNK))
        for offset in range(begin, end, CHUNK):
            started = time.perf_counter()
            _pwrite_all(fd, zeros[: min(CHUNK, end - offset)], offset)
            _touch_again(fd, readback[: min(CHUNK, end - offset)], offset)
            if not self._hurry.is_set() and self._duty < 1:
                self._hurry.wait((time.perf_counter() - started) * (1 / self._duty - 1))

    def _drop_locked(self) -> None:
        prepared, self._file = self._file, None
        if prepared is not None:
            prepared.remove()
            log.debug("send segment %s removed", prepared.path)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _touch_again(fd: int, buffer: memoryview, offset: int) -> None:
    """Read back what was just written: pages touched once and then written by the first send still cost that send
    about 1.5x what a rewrite does (309 MB on the 2-core box, quiet: 55-83 ms against 41-55 ms), touched twice they
    cost what a rewrite does (41 ms) -- presumably the kernel moving them to its active list on their second use."""
    done = 0
    while done < buffer.nbytes:
        read = os.preadv(fd, [buffer[done:]], offset + done)
        if read == 0:
            return
        done += read


def _touch(prepared: PreparedFile) -> None:
    try:
        os.utime(prepared.fd)
    except OSError:
        pass


def _remove(path: Path, fd: int) -> None:
    """Unlink the segment (if the path is still this file) and close its descriptor (at the latest at exit)."""
    _unlink_if_ours(path, fd)
    _close(fd)


def _unlink_if_ours(path: Path, fd: int) -> None:
    try:
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except OSError:
        pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
