"""Same-host transports of a packed training state: host shared memory and CUDA IPC (Elan §IV: IO-free).

Both have the shape of :mod:`lightning_elan.replication.transport` (a source sends ``cpu_state`` and ``tensors``,
destinations receive ``(cpu_state, tensors, bytes)``; the header travels pickled through the store under
``prefix + "/header"``), but no process group: the bytes go through memory both processes map.

* **Shared memory** (:func:`send_state_shm` / :func:`receive_state_shm`, levels L2/L3, and CPU workers): the source
  packs every buffer once into one file in ``/dev/shm`` (an *arena*, each dtype buffer 256-byte aligned; CUDA tensors
  are packed on the GPU first, then copied down once); each destination maps the file privately (copy-on-write) and
  copies the bytes bound for its GPU there; the CPU-bound ones it uses in place (``zero_copy``, the default: no copy,
  no fresh pages) or copies (``zero_copy=False``). The source unlinks the file as soon as every destination mapped it.
* **CUDA IPC** (:func:`send_state_ipc` / :func:`receive_state_ipc`, levels L0/L1): the source packs into one GPU
  arena (one kernel launch with the CUDA extension), exports one IPC handle; each destination opens it and copies
  device to device (P2P across GPUs), then acknowledges; the source frees the arena after every acknowledgement.

Each source side is also available in two steps, ``share_state_*`` (pack + publish, returns at once) and the share's
``wait()``/``close()``, so a stayer can resume training while the joiners copy (the arena is a separate copy of the
state). Destinations of a sliced plan (Or et al.) use :class:`ShmReader`/:class:`IpcReader` and ``copy_to`` with a
byte range of :func:`~lightning_elan.replication.planner.slice_range`.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import pickle
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.replication.cuda import ipc, kernels
from lightning_elan.replication.cuda.ipc import IpcHandle
from lightning_elan.replication.packing import (
    ArenaLayout,
    PackedLayout,
    arena_layout,
    arena_views,
    empty_buffers,
    make_layout,
    state_nbytes,
    unpack,
)
from lightning_elan.replication.transport import DEFAULT_TIMEOUT, header_key

log = logging.getLogger(__name__)

__all__ = [
    "IpcReader",
    "IpcShare",
    "ShmReader",
    "ShmShare",
    "ShmUnavailable",
    "default_shm_dir",
    "mark_wave_received",
    "publish_fallback",
    "receive_state_ipc",
    "receive_state_shm",
    "remove_stale_segments",
    "send_state_ipc",
    "send_state_shm",
    "share_state_ipc",
    "share_state_shm",
    "wait_for_wave",
]

SHM_DIR_ENV = "ELAN_SHM_DIR"
_MAX_IO = 1 << 30  # bytes per pwrite/preadv call (Linux caps one call at 2 GiB - 4 KiB)
SHM_FORMAT = "elan-shm/1"
IPC_FORMAT = "elan-ipc/1"
_POLL_MIN_S = 1e-4
_POLL_MAX_S = 1e-2


class ShmUnavailable(RuntimeError):
    """This same-host transport cannot be used (no shared-memory space, CUDA IPC refused...): use the collective.

    Raised on the source by ``share_state_*``; after :func:`publish_fallback` it is raised on the destinations too, so
    both sides switch to the collective transport together.
    """


def default_shm_dir() -> Path:
    """``$ELAN_SHM_DIR`` if set (e.g. a larger tmpfs than a container's 64 MB ``/dev/shm``), else ``/dev/shm`` where
    it exists (Linux tmpfs), else the temporary directory."""
    if os.environ.get(SHM_DIR_ENV):
        return Path(os.environ[SHM_DIR_ENV])
    path = Path("/dev/shm")
    if path.is_dir() and os.access(path, os.W_OK):
        return path
    import tempfile

    return Path(tempfile.gettempdir())


# --------------------------------------------------------------------------------------------
# store helpers
# --------------------------------------------------------------------------------------------


def _ack_key(prefix: str) -> str:
    return f"{prefix}/acks"


def _publish(store: dist.Store, prefix: str, header: dict[str, Any]) -> int:
    data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    store.set(header_key(prefix), data)
    return len(data)


def _fetch_header(store: dist.Store, prefix: str, fmt: str, timeout: datetime.timedelta) -> tuple[dict[str, Any], int]:
    store.wait([header_key(prefix)], timeout)
    data = store.get(header_key(prefix))
    header = pickle.loads(data)
    if not isinstance(header, dict) or header.get("format") != fmt:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise RuntimeError(f"transfer {prefix}: expected a {fmt} header, got {got!r}")
    if header.get("fallback"):
        raise ShmUnavailable(f"transfer {prefix}: the source fell back to the collective: {header['fallback']}")
    return header, len(data)


def publish_fallback(store: dist.Store, prefix: str, transport: str, reason: str) -> None:
    """Tell the destinations of ``prefix`` (``transport``: ``"shm"`` or ``"cuda_ipc"``) that this transfer goes over
    the collective instead: their ``receive_state_*`` / reader raises :class:`ShmUnavailable`."""
    fmt = {"shm": SHM_FORMAT, "cuda_ipc": IPC_FORMAT}[transport]
    _publish(store, prefix, {"format": fmt, "fallback": reason or "unavailable"})


# --------------------------------------------------------------------------------------------
# waves: copies that share a cross-socket link run in turn, across sources
# --------------------------------------------------------------------------------------------


def _wave_key(prefix: str, wave: int) -> str:
    return f"{prefix}/wave{wave}/received"


def mark_wave_received(store: dist.Store, prefix: str, wave: int) -> None:
    """A joiner finished receiving its transfer of ``wave`` (``prefix``: one per adjustment, e.g. the generation's)."""
    store.add(_wave_key(prefix, wave), 1)


def wait_for_wave(
    store: dist.Store, prefix: str, wave: int, transfers_in_previous_wave: int, timeout: datetime.timedelta
) -> None:
    """A source about to send a transfer of ``wave`` > 0 waits until every transfer of ``wave - 1`` was received."""
    if wave <= 0 or transfers_in_previous_wave <= 0:
        return
    _wait_count(store, _wave_key(prefix, wave - 1), transfers_in_previous_wave, timeout, f"wave {wave - 1}")


def _wait_acks(store: dist.Store, prefix: str, count: int, timeout: datetime.timedelta) -> None:
    """Block until ``count`` destinations acknowledged (``store.add`` on the ack key), or raise ``TimeoutError``."""
    _wait_count(store, _ack_key(prefix), count, timeout, f"transfer {prefix}: destinations")


def _wait_count(store: dist.Store, key: str, count: int, timeout: datetime.timedelta, what: str) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    delay = _POLL_MIN_S
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {store.add(key, 0)} of {count} acknowledged within {timeout}")
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _ack(store: dist.Store, prefix: str) -> None:
    store.add(_ack_key(prefix), 1)


# --------------------------------------------------------------------------------------------
# copying an arena byte range into per-key buffers (both readers)
# --------------------------------------------------------------------------------------------

CopyFn = Callable[[torch.Tensor, int], None]  # (contiguous destination bytes, source offset in the arena)


def _copy_range(places: ArenaLayout, buffers: dict[str, torch.Tensor], start: int, stop: int, copy: CopyFn) -> int:
    """Copy the part of each key's region that falls in ``[start, stop)`` of the arena; returns the bytes copied."""
    copied = 0
    for key, offset in places.offsets.items():
        lo, hi = max(start, offset), min(stop, offset + places.sizes[key])
        if lo >= hi:
            continue
        dst = buffers[key].view(torch.uint8)[lo - offset : hi - offset]
        copy(dst, lo)
        copied += hi - lo
    return copied


def _arena_pieces(
    tensors: list[torch.Tensor], layout: PackedLayout, places: ArenaLayout
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(arena byte offset, contiguous CPU uint8 bytes)`` pieces that together write the packed state.

    CPU tensors go one by one, no staging copy; a state with CUDA tensors is packed on its GPUs first (one launch per
    device with the extension), then each buffer is copied down once.
    """
    if any(t.is_cuda for t in tensors):
        buffers, _ = kernels.pack(tensors)
        for key, buffer in buffers.items():
            yield places.offsets[key], _raw_bytes(buffer.cpu())
        return
    for spec, t in zip(layout.specs, tensors, strict=True):
        if spec.numel:
            yield places.offsets[spec.key] + spec.offset * t.element_size(), _raw_bytes(t)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _pwrite_all(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.numpy())
    while view.nbytes:
        written = os.pwrite(fd, view[:_MAX_IO], offset)
        view, offset = view[written:], offset + written


# --------------------------------------------------------------------------------------------
# shared memory
# --------------------------------------------------------------------------------------------


@dataclass
class ShmShare:
    """A published shared-memory segment; :meth:`wait` for the destinations, then :meth:`close` to unlink it."""

    store: dist.Store
    prefix: str
    path: Path
    receivers: int
    nbytes: int  # packed bytes + header bytes (what send_state_shm returns)

    def wait(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        """Until every destination has mapped the segment (after that, unlinking it is safe)."""
        _wait_acks(self.store, self.prefix, self.receivers, timeout)

    def close(self) -> None:
        """Unlink the segment (idempotent); destinations that mapped it keep their mapping."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def share_state_shm(
    store: dist.Store,
    prefix: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
    receivers: int = 1,
    *,
    shm_dir: str | os.PathLike[str] | None = None,
) -> ShmShare:
    """Pack ``tensors`` into a new shared-memory segment and publish the header; returns without waiting.

    Raises :class:`ShmUnavailable` when the segment cannot be created (the caller falls back to the collective).
    """
    t0 = time.perf_counter()
    layout = make_layout(tensors)
    places = arena_layout(layout)
    directory = Path(shm_dir or default_shm_dir())
    remove_stale_segments(directory)
    path = directory / f"elan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        _write_segment(path, tensors, layout, places)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    header = {"format": SHM_FORMAT, "cpu_state": cpu_state, "layout": layout, "arena": places, "path": str(path)}
    header_len = _publish(store, prefix, header)
    log.debug("shm %s: %d bytes packed into %s in %.1f ms", prefix, places.nbytes, path, _ms(t0))
    return ShmShare(store, prefix, path, receivers, sum(places.sizes.values()) + header_len)


def send_state_shm(
    store: dist.Store,
    prefix: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
    receivers: int = 1,
    *,
    shm_dir: str | os.PathLike[str] | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> int:
    """Send to ``receivers`` destinations on this host; returns once all have mapped the segment (bytes sent)."""
    share = share_state_shm(store, prefix, cpu_state, tensors, receivers, shm_dir=shm_dir)
    try:
        share.wait(timeout)
    finally:
        share.close()
    return share.nbytes


def remove_stale_segments(directory: Path, older_than: datetime.timedelta = 2 * DEFAULT_TIMEOUT) -> list[Path]:
    """Delete segments a crashed source left behind: a live one exists only until its destinations mapped it, far
    less than ``older_than`` (twice the transfer timeout). Returns what was removed."""
    removed = []
    cutoff = time.time() - older_than.total_seconds()
    for path in directory.glob("elan-*"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    if removed:
        log.warning("removed %d stale shared-memory segments from %s", len(removed), directory)
    return removed


def _write_segment(path: Path, tensors: list[torch.Tensor], layout: PackedLayout, places: ArenaLayout) -> None:
    """Create the segment file and write the arena into it with ``pwrite``, each piece at its arena offset.

    Whole pages written into tmpfs are allocated without being zeroed first, and nothing is mapped into this process:
    the former ``posix_fallocate`` + ``MAP_POPULATE`` + copy zeroed and mapped every page, then copied (309 MB on the
    2-core box, warm: 106 ms against 308 ms). A full tmpfs fails the write (ENOSPC: :class:`ShmUnavailable` here, never
    a SIGBUS in a reader later). Alignment padding stays a hole, which reads as zeros.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as error:
        raise ShmUnavailable(f"cannot create {path}: {error}") from error
    try:
        os.ftruncate(fd, places.nbytes)
        for offset, data in _arena_pieces(tensors, layout, places):
            _pwrite_all(fd, data, offset)
    except OSError as error:
        raise ShmUnavailable(f"cannot write {places.nbytes} bytes to {path}: {error}") from error
    finally:
        os.close(fd)


def _populate() -> int:
    return getattr(mmap, "MAP_POPULATE", 0)  # pre-fault the pages in one call (Linux)


def _as_tensor(mapping: mmap.mmap | None) -> torch.Tensor:
    """A uint8 tensor over the whole mapping. It holds a reference to the ``mmap`` object, which unmaps when the last
    tensor viewing it is gone: never ``close()`` such a mapping (torch does not pin the buffer; it would dangle)."""
    if mapping is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a private (copy-on-write) mapping is writable anyway
        return torch.frombuffer(mapping, dtype=torch.uint8)


class ShmReader:
    """A destination's view of a published segment: header read, segment opened and acknowledged on open.

    The open file keeps the segment alive once the source unlinks it. It is mapped (privately, copy-on-write) only
    for zero-copy buffers and byte ranges; copied buffers are read with one ``preadv`` into memory of this process.
    """

    def __init__(self, store: dist.Store, prefix: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        header, self.header_bytes = _fetch_header(store, prefix, SHM_FORMAT, timeout)
        self.prefix = prefix
        self.cpu_state: Any = header["cpu_state"]
        self.layout: PackedLayout = header["layout"]
        self.places: ArenaLayout = header["arena"]
        self._fd: int | None = os.open(header["path"], os.O_RDONLY)
        _ack(store, prefix)  # open: the source may unlink the file now
        self._arena: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.places.nbytes

    def buffers(self, device_for: Callable[[str], torch.device], zero_copy: bool = True) -> dict[str, torch.Tensor]:
        """The packed buffers on the devices ``device_for`` names. CPU ones are views of the private mapping with
        ``zero_copy`` (no copy, but the segment stays mapped while they live), else views of a copy this process owns
        (one read of the whole segment); buffers bound for another device are copied there."""
        arena = self._mapped() if zero_copy else self._read_all()
        out: dict[str, torch.Tensor] = {}
        for key, view in arena_views(arena, self.places).items():
            device = torch.device(device_for(key.rpartition(":")[0]))
            out[key] = view if device.type == "cpu" else view.to(device)
        return out

    def copy_to(self, buffers: dict[str, torch.Tensor], start: int = 0, stop: int | None = None) -> int:
        """Copy arena bytes ``[start, stop)`` into ``buffers`` (from ``empty_buffers(self.layout, ...)``)."""
        arena = self._mapped()
        stop = self.nbytes if stop is None else stop
        return _copy_range(self.places, buffers, start, stop, lambda dst, at: dst.copy_(arena[at : at + dst.numel()]))

    def _open_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"transfer {self.prefix}: reader is closed")
        return self._fd

    def _mapped(self) -> torch.Tensor:
        fd = self._open_fd()
        if self._arena is None:
            self._arena = _as_tensor(_map_private(fd, self.places.nbytes))
        return self._arena

    def _read_all(self) -> torch.Tensor:
        arena = torch.empty(self.places.nbytes, dtype=torch.uint8)
        view, offset = memoryview(arena.numpy()), 0
        while view.nbytes:
            count = os.preadv(self._open_fd(), [view[:_MAX_IO]], offset)
            if count == 0:
                raise RuntimeError(f"transfer {self.prefix}: segment ended {view.nbytes} bytes early")
            view, offset = view[count:], offset + count
        return arena

    def close(self) -> None:
        """Close the file and drop this reader's mapping; zero-copy buffers keep the mapping alive until they go."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._arena = None

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map_private(fd: int, nbytes: int) -> mmap.mmap | None:
    """A private, copy-on-write mapping of the segment (writes stay in this process), pre-faulted."""
    if nbytes == 0:
        return None
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE | _populate(), prot=mmap.PROT_READ | mmap.PROT_WRITE)


def receive_state_shm(
    store: dist.Store,
    prefix: str,
    device_for: Callable[[str], torch.device],
    *,
    zero_copy: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> tuple[Any, list[torch.Tensor], int]:
    """Receive what :func:`send_state_shm` sends: ``(cpu_state, tensors, bytes_received)`` (tensors: buffer views).

    With ``zero_copy`` the tensors bound for the CPU are views of a private (copy-on-write) mapping of the segment:
    no copy, no fresh pages; writing to them copies only the pages written. The rest is copied to its device.
    """
    t0 = time.perf_counter()
    with ShmReader(store, prefix, timeout) as reader:
        buffers = reader.buffers(device_for, zero_copy)
        _sync(buffers)
    log.debug("shm %s: received %d bytes in %.1f ms", prefix, reader.nbytes, _ms(t0))
    return reader.cpu_state, unpack(buffers, reader.layout), state_nbytes(buffers) + reader.header_bytes


# --------------------------------------------------------------------------------------------
# CUDA IPC
# --------------------------------------------------------------------------------------------


@dataclass
class IpcShare:
    """A published GPU arena; :meth:`wait` for every destination's copy, then :meth:`close` to free it."""

    store: dist.Store
    prefix: str
    arena: torch.Tensor | None
    receivers: int
    nbytes: int

    def wait(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        """Until every destination has finished copying."""
        _wait_acks(self.store, self.prefix, self.receivers, timeout)

    def close(self) -> None:
        """Free the arena (only after :meth:`wait`: destinations read it until they acknowledge)."""
        self.arena = None


def share_state_ipc(
    store: dist.Store,
    prefix: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
    device: torch.device | str | int,
    receivers: int = 1,
) -> IpcShare:
    """Pack ``tensors`` into one shareable arena on CUDA ``device``, export it and publish the header.

    Raises :class:`ShmUnavailable` when the arena cannot be allocated or exported (fall back to the collective).
    """
    t0 = time.perf_counter()
    device = torch.device("cuda", ipc.device_index(device))
    layout = make_layout(tensors)
    places = arena_layout(layout)
    arena, handle = None, None
    if places.nbytes:
        try:
            arena = ipc.alloc_shareable(places.nbytes, device)
            kernels.pack_into(tensors, layout, arena_views(arena, places))
            torch.cuda.synchronize(device)  # the bytes are in place before anyone can open the handle
            handle = ipc.ipc_export(arena)
        except (RuntimeError, OSError) as error:  # out of memory, IPC refused (containers without --ipc=host)...
            raise ShmUnavailable(f"CUDA IPC export of {places.nbytes} bytes on {device} failed: {error}") from error
    header = {"format": IPC_FORMAT, "cpu_state": cpu_state, "layout": layout, "arena": places, "handle": handle}
    header_len = _publish(store, prefix, header)
    kind = handle.kind if handle else "empty"
    log.debug("ipc %s: %d bytes packed on %s (%s) in %.1f ms", prefix, places.nbytes, device, kind, _ms(t0))
    return IpcShare(store, prefix, arena, receivers, sum(places.sizes.values()) + header_len)


def send_state_ipc(
    store: dist.Store,
    prefix: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
    device: torch.device | str | int,
    receivers: int = 1,
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> int:
    """Send to ``receivers`` destinations on this host over CUDA IPC; returns once all have copied (bytes sent)."""
    share = share_state_ipc(store, prefix, cpu_state, tensors, device, receivers)
    try:
        share.wait(timeout)
    finally:
        share.close()
    return share.nbytes


class IpcReader:
    """A destination's view of a published GPU arena, opened on ``device``; :meth:`close` acknowledges."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        device: torch.device | str | int,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        header, self.header_bytes = _fetch_header(store, prefix, IPC_FORMAT, timeout)
        self.store, self.prefix = store, prefix
        self.cpu_state: Any = header["cpu_state"]
        self.layout: PackedLayout = header["layout"]
        self.places: ArenaLayout = header["arena"]
        handle: IpcHandle | None = header["handle"]
        self._mapping = ipc.ipc_open(handle, device) if handle is not None else None
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self.places.nbytes

    def copy_to(self, buffers: dict[str, torch.Tensor], start: int = 0, stop: int | None = None) -> int:
        """Issue the copies of arena bytes ``[start, stop)`` into ``buffers``; :meth:`close` waits for them."""
        if self._closed:
            raise RuntimeError(f"transfer {self.prefix}: reader is closed")
        if self._mapping is None:  # an empty state: nothing to copy
            return 0
        stop = self.nbytes if stop is None else stop
        return _copy_range(self.places, buffers, start, stop, self._mapping.copy_to)

    def close(self) -> None:
        """Wait for the copies, unmap, and tell the source it may free the arena (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        _ack(self.store, self.prefix)

    def __enter__(self) -> IpcReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive_state_ipc(
    store: dist.Store,
    prefix: str,
    device: torch.device | str | int,
    device_for: Callable[[str], torch.device],
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> tuple[Any, list[torch.Tensor], int]:
    """Receive what :func:`send_state_ipc` sends, copying on CUDA ``device``: ``(cpu_state, tensors, bytes)``."""
    t0 = time.perf_counter()
    with IpcReader(store, prefix, device, timeout) as reader:
        buffers = empty_buffers(reader.layout, device_for)
        reader.copy_to(buffers)
    log.debug("ipc %s: received %d bytes in %.1f ms", prefix, reader.nbytes, _ms(t0))
    return reader.cpu_state, unpack(buffers, reader.layout), state_nbytes(buffers) + reader.header_bytes


# --------------------------------------------------------------------------------------------


def _sync(buffers: dict[str, torch.Tensor]) -> None:
    for device in {b.device for b in buffers.values() if b.is_cuda}:
        torch.cuda.synchronize(device)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
