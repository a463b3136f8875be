"""The shared-memory transport (levels L2/L3, and CPU workers): one segment in ``/dev/shm`` per source (Elan §IV).

The source packs every buffer once into one file in ``$ELAN_SHM_DIR`` (default ``/dev/shm``), an *arena* with each
dtype buffer 256-byte aligned (CUDA tensors are packed on the GPU first, then copied down once), and publishes the
header; ``send`` returns at once. Each reader opens the file, acknowledges (the source may unlink it now: the open file
keeps it alive), then reads it: into memory of its own (``zero_copy=False``, the default: nothing stays mapped from
``/dev/shm``, and the reader owns what it trains on) or as views of a private copy-on-write mapping
(``zero_copy=True``: no copy, no fresh pages, but the segment stays mapped while the tensors live). Buffers bound for
a GPU are copied there. :meth:`ShmTransport.disallow` waits for every reader's acknowledgement and unlinks the file.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_elan.protocol.contract import ENV_SHM_DIR
from lightning_elan.replication.cuda import kernels
from lightning_elan.replication.packing import (
    ArenaLayout,
    PackedLayout,
    arena_layout,
    arena_views,
    make_layout,
    state_nbytes,
    unpack,
)
from lightning_elan.replication.transports.base import (
    DEFAULT_TIMEOUT,
    Channel,
    DeviceFor,
    Received,
    StateTransport,
    TransportUnavailable,
)

log = logging.getLogger(__name__)

__all__ = ["SHM_DIR_ENV", "ShmTransport", "default_shm_dir", "remove_stale_segments"]

SHM_DIR_ENV = ENV_SHM_DIR
_MAX_IO = 1 << 30  # bytes per pwrite/preadv call (Linux caps one call at 2 GiB - 4 KiB)


def default_shm_dir() -> Path:
    """``$ELAN_SHM_DIR`` if set (e.g. a larger tmpfs than a container's 64 MB ``/dev/shm``), else ``/dev/shm`` where
    it exists (Linux tmpfs), else the temporary directory."""
    if os.environ.get(SHM_DIR_ENV):
        return Path(os.environ[SHM_DIR_ENV])
    path = Path("/dev/shm")
    if path.is_dir() and os.access(path, os.W_OK):
        return path
    return Path(tempfile.gettempdir())


class ShmTransport(StateTransport):
    """One shared-memory segment per source, read by every reader on this host."""

    name = "shm"
    header_format = "elan-shm/1"
    same_host = True

    def __init__(
        self, channel: Channel, *, shm_dir: str | os.PathLike[str] | None = None, zero_copy: bool = False
    ) -> None:
        super().__init__(channel)
        self.shm_dir = Path(shm_dir) if shm_dir is not None else None
        self.zero_copy = zero_copy
        self.path: Path | None = None
        self._readers = 0

    @override
    def send(self, cpu_state: Any, tensors: list[torch.Tensor], readers: int) -> int:
        """Pack into a new segment and publish the header; raises :class:`TransportUnavailable` if it cannot be made."""
        t0 = time.perf_counter()
        layout = make_layout(tensors)
        places = arena_layout(layout)
        directory = self.shm_dir or default_shm_dir()
        remove_stale_segments(directory)
        path = directory / f"elan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            _write_segment(path, tensors, layout, places)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self.path, self._readers = path, readers
        header = {"format": self.header_format, "cpu_state": cpu_state, "layout": layout, "arena": places,
                  "path": str(path)}  # fmt: skip
        header_len = self._publish_header(header)
        log.debug("shm %s: %d bytes packed into %s in %.1f ms", self.channel.prefix, places.nbytes, path, _ms(t0))
        return sum(places.sizes.values()) + header_len

    @override
    def receive(self, reader: int, device_for: DeviceFor) -> Received:
        t0 = time.perf_counter()
        header, header_len = self._fetch_header()
        layout: PackedLayout = header["layout"]
        places: ArenaLayout = header["arena"]
        fd = os.open(header["path"], os.O_RDONLY)
        try:
            self._ack()  # open: the source may unlink the file now
            arena = _map_private(fd, places.nbytes) if self.zero_copy else _read_all(fd, places.nbytes)
        finally:
            os.close(fd)  # a mapping outlives its file descriptor
        buffers = _place(arena_views(arena, places), device_for)
        log.debug("shm %s: received %d bytes in %.1f ms", self.channel.prefix, places.nbytes, _ms(t0))
        return Received(header["cpu_state"], unpack(buffers, layout), state_nbytes(buffers) + header_len)

    @override
    def _stop_serving(self) -> None:
        """Every reader has opened the segment: unlink it (readers keep what they opened)."""
        self._unlink()

    @override
    def shutdown(self) -> None:
        self._unlink()
        super().shutdown()

    def _unlink(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def remove_stale_segments(directory: Path, older_than: datetime.timedelta = 2 * DEFAULT_TIMEOUT) -> list[Path]:
    """Delete segments a crashed source left behind: a live one exists only until its readers opened it, far less than
    ``older_than`` (twice the transfer timeout). Returns what was removed."""
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


# --------------------------------------------------------------------------------------------
# writing a segment (source)
# --------------------------------------------------------------------------------------------


def _write_segment(path: Path, tensors: list[torch.Tensor], layout: PackedLayout, places: ArenaLayout) -> None:
    """Create the segment file and write the arena into it with ``pwrite``, each piece at its arena offset.

    Whole pages written into tmpfs are allocated without being zeroed first, and nothing is mapped into this process:
    the former ``posix_fallocate`` + ``MAP_POPULATE`` + copy zeroed and mapped every page, then copied (309 MB on the
    2-core box, warm: 106 ms against 308 ms). A full tmpfs fails the write (ENOSPC: :class:`TransportUnavailable`
    here, never a SIGBUS in a reader later). Alignment padding stays a hole, which reads as zeros.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as error:
        raise TransportUnavailable(f"cannot create {path}: {error}") from error
    try:
        os.ftruncate(fd, places.nbytes)
        for offset, data in _arena_pieces(tensors, layout, places):
            _pwrite_all(fd, data, offset)
    except OSError as error:
        raise TransportUnavailable(f"cannot write {places.nbytes} bytes to {path}: {error}") from error
    finally:
        os.close(fd)


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
# reading a segment (readers)
# --------------------------------------------------------------------------------------------


def _read_all(fd: int, nbytes: int) -> torch.Tensor:
    """The whole segment read (``preadv``) into memory this process owns."""
    arena = torch.empty(nbytes, dtype=torch.uint8)
    view, offset = memoryview(arena.numpy()), 0
    while view.nbytes:
        count = os.preadv(fd, [view[:_MAX_IO]], offset)
        if count == 0:
            raise RuntimeError(f"shared-memory segment ended {view.nbytes} bytes early")
        view, offset = view[count:], offset + count
    return arena


def _map_private(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a private, copy-on-write, pre-faulted mapping of the segment (writes stay here).

    The tensor holds a reference to the ``mmap`` object, which unmaps when the last tensor viewing it is gone: never
    ``close()`` such a mapping (torch does not pin the buffer; it would dangle).
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    populate = getattr(mmap, "MAP_POPULATE", 0)  # pre-fault the pages in one call (Linux)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a private (copy-on-write) mapping is writable anyway
        return torch.frombuffer(mapping, dtype=torch.uint8)


def _place(views: dict[str, torch.Tensor], device_for: DeviceFor) -> dict[str, torch.Tensor]:
    """Each buffer on the device ``device_for`` names: CPU ones as they are, the others copied there (synchronised)."""
    out: dict[str, torch.Tensor] = {}
    for key, view in views.items():
        device = torch.device(device_for(key.rpartition(":")[0]))
        out[key] = view if device.type == "cpu" else view.to(device)
    for device in {b.device for b in out.values() if b.is_cuda}:
        torch.cuda.synchronize(device)
    return out


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
