"""The shared-memory transport (levels L2/L3, and CPU workers): one segment in ``/dev/shm`` per source (Elan §IV).

The source creates one file in ``$ELAN_SHM_DIR`` (default ``/dev/shm``), an *arena* with each dtype buffer 256-byte
aligned, publishes the header (layout, path) first, then writes the state into it in arena order and counts the bytes
written so far in the store (``{prefix}/written``, every ``STREAM_CHUNK`` bytes); ``send`` returns once all is
written. CUDA tensors are packed on the GPU first, then copied down once. Each reader opens the file, reads it as it
is written and then acknowledges (the source may unlink it and delete the count now) — the transfer is a
pipeline: the reader copies chunk *i* while the source writes chunk *i + 1*, and the reader's own memory is allocated
and faulted in (one ``MAP_POPULATE``) while the source writes the first chunk. A reader reads into memory of its own
(``zero_copy=False``, the default: nothing stays mapped from ``/dev/shm``, and the reader owns what it trains on) or,
once the whole file is written, as views of a private copy-on-write mapping (``zero_copy=True``: no copy, no fresh
pages, but the segment stays mapped while the tensors live). Buffers bound for a GPU are copied there. A source that
fails to write (a full tmpfs) marks the count failed: its readers raise :class:`TransportUnavailable` and both sides
move to the collective. :meth:`ShmTransport.disallow` waits for every reader's acknowledgement and unlinks the file.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_elan.protocol.contract import shm_directory
from lightning_elan.replication.cuda import kernels
from lightning_elan.replication.packing import (
    ArenaLayout,
    PackedLayout,
    TensorSpec,
    arena_layout,
    arena_views,
    as_received,
    dtype_from_str,
    make_layout,
    unpack,
    with_own_storage,
)
from lightning_elan.replication.reception import (
    PrefaultedMemory,
    ReceiveInto,
    ReceivePiece,
    populated,
    receive_pieces,
    usable_destinations,
)
from lightning_elan.replication.send_segment import PreparedFile, SendSegment
from lightning_elan.replication.transports.base import (
    DEFAULT_TIMEOUT,
    Channel,
    DeviceFor,
    Received,
    StateTransport,
    TransferCancelled,
    TransportUnavailable,
)

log = logging.getLogger(__name__)

__all__ = ["ShmTransport", "default_shm_dir", "remove_stale_segments"]

_MAX_IO = 1 << 30  # bytes per pwrite/preadv call (Linux caps one call at 2 GiB - 4 KiB)
STREAM_CHUNK = 16 << 20
"""The source tells its readers how far it has written every this many bytes."""
_WRITE_FAILED = -(1 << 62)  # added to the written-bytes count by a source whose write failed


def default_shm_dir() -> Path:
    """This process's segment directory (:func:`~lightning_elan.protocol.contract.shm_directory`)."""
    return shm_directory(os.environ)


class ShmTransport(StateTransport):
    """One shared-memory segment per source, read by every reader on this host."""

    name = "shm"
    header_format = "elan-shm/2"
    same_host = True

    def __init__(
        self, channel: Channel, *, shm_dir: str | os.PathLike[str] | None = None, zero_copy: bool = False,
        segment: SendSegment | None = None,
    ) -> None:
        super().__init__(channel)
        self.shm_dir = Path(shm_dir) if shm_dir is not None else None
        self.zero_copy = zero_copy
        self.segment = segment  # the source's segment made ahead (sending), written instead of a new file
        self.path: Path | None = None
        self._prepared: PreparedFile | None = None  # taken from ``segment`` for this send
        self._readers = 0

    @override
    def send(self, cpu_state: Any, tensors: list[torch.Tensor], readers: int) -> int:
        """Create the segment (or take the one made ahead), publish the header, then write the state while readers
        copy what is written; raises :class:`TransportUnavailable` if the segment cannot be made or written (its
        readers learn it from the count)."""
        t0 = time.perf_counter()
        layout = make_layout(tensors)
        places = arena_layout(layout)
        path, fd = self._open_for_writing(places.nbytes)
        self.path, self._readers = path, readers
        header = {"format": self.header_format, "cpu_state": cpu_state, "layout": layout, "arena": places,
                  "path": str(path)}  # fmt: skip
        try:
            header_len = self._publish_header(header)
            _write_segment(fd, path, tensors, layout, places, self._progress)
        except TransportUnavailable:
            self.channel.store.add(self._written_key, _WRITE_FAILED)
            self._discard()
            raise
        finally:
            os.close(fd)
        log.debug("shm %s: %d bytes written into %s %s in %.1f ms", self.channel.prefix, places.nbytes,
                  "made ahead" if self._prepared is not None else "new", path, _ms(t0))
        return sum(places.sizes.values()) + header_len

    def _open_for_writing(self, nbytes: int) -> tuple[Path, int]:
        """The segment this send writes (a descriptor of its own): the one made ahead if there is one, else new."""
        prepared = self.segment.take(nbytes) if self.segment is not None else None
        if prepared is not None:
            self._prepared = prepared
            return prepared.path, os.dup(prepared.fd)
        directory = self.shm_dir or default_shm_dir()
        remove_stale_segments(directory)
        path = directory / f"elan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return path, _create_segment(path, nbytes)

    @property
    def _written_key(self) -> str:
        return f"{self.channel.prefix}/written"

    def _progress(self, nbytes: int) -> None:
        """``nbytes`` more bytes of the arena, from its start, are written."""
        self.channel.store.add(self._written_key, nbytes)

    @override
    def receive(self, reader: int, device_for: DeviceFor, into: ReceiveInto | None = None) -> Received:
        t0 = time.perf_counter()
        header, header_len = self._fetch_header()
        layout: PackedLayout = header["layout"]
        places: ArenaLayout = header["arena"]
        into = into if into is not None and not self.zero_copy and _stays_on_cpu(layout, device_for) else None
        own = {} if into is None else usable_destinations(layout, into.destinations(header["cpu_state"]), device_for)
        fd, prefaulted = self._open_segment(header["path"]), False
        try:
            if into is not None:
                tensors, prefaulted = self._read_into_own(fd, layout, places, own, into.spare)
            else:
                tensors = unpack(_place(arena_views(self._read_arena(fd, places.nbytes), places), device_for), layout)
            self._ack()  # read (or mapped): the source may unlink the file and delete the count now
        finally:
            os.close(fd)  # a mapping outlives its file descriptor
        in_place = sum(t.numel() * t.element_size() for t in own.values())
        log.debug("shm %s: received %d bytes in %.1f ms (%d into its own tensors, prefaulted: %s)",
                  self.channel.prefix, places.nbytes, _ms(t0), in_place, prefaulted)
        return Received(header["cpu_state"], tensors, sum(places.sizes.values()) + header_len, in_place, prefaulted)

    def _read_arena(self, fd: int, nbytes: int) -> torch.Tensor:
        """The whole arena: copied into memory of this process as it is written, or mapped (``zero_copy``)."""
        if not self.zero_copy:
            return self._read_as_written(fd, nbytes)
        self._await_written(nbytes, nbytes)
        return _map_private(fd, nbytes)

    def _open_segment(self, path: str) -> int:
        """The source's segment, open for reading; a source whose write failed has removed it already."""
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if self.channel.store.add(self._written_key, 0) < 0:
                raise TransportUnavailable(f"shm {self.channel.prefix}: the source could not write the segment"
                                           ) from None
            raise

    def _read_as_written(self, fd: int, nbytes: int) -> torch.Tensor:
        """The segment copied into memory of this process, each part as soon as the source has written it."""
        arena = populated(nbytes)
        self._read_range_as_written(fd, memoryview(arena.numpy()), 0, nbytes)
        return arena

    def _read_into_own(self, fd: int, layout: PackedLayout, places: ArenaLayout, own: dict[int, torch.Tensor],
                       spare: PrefaultedMemory | None) -> tuple[list[torch.Tensor], bool]:
        """The segment read as it is written straight into the reader's own tensors (``own``, CPU), the rest into
        local memory (``spare`` if it fits, else freshly faulted in): the tensors in the source's order, and whether
        the spare was used."""
        pieces, local_nbytes = receive_pieces(layout, places, set(own))
        local = spare.take(local_nbytes) if spare is not None else None
        prefaulted = local is not None
        if local is None:
            local = populated(local_nbytes)
        tensors = _local_tensors(layout, pieces, local, own)
        for piece in pieces:
            target = memoryview(_raw_bytes(tensors[piece.index]).numpy())
            self._read_range_as_written(fd, target, piece.arena_offset, places.nbytes)
        return tensors, prefaulted

    def _read_range_as_written(self, fd: int, target: memoryview, offset: int, nbytes: int) -> None:
        """Fill ``target`` from the arena at ``offset`` (of ``nbytes``), each part as soon as the source wrote it."""
        done = 0
        while done < target.nbytes:
            written = self._await_written(offset + done + 1, nbytes)
            end = min(written - offset, target.nbytes)
            _read_into(fd, target[done:end], offset + done)
            done = end

    def _await_written(self, at_least: int, nbytes: int) -> int:
        """Bytes of the arena written so far, once there are ``at_least`` (at most ``nbytes``)."""
        store, key = self.channel.store, self._written_key
        deadline = time.monotonic() + self.channel.timeout.total_seconds()
        delay = 1e-4
        while (written := store.add(key, 0)) < at_least:
            if written < 0:
                raise TransportUnavailable(f"shm {self.channel.prefix}: the source could not write the segment")
            if self.channel.cancelled is not None and self.channel.cancelled():
                raise TransferCancelled(f"shm {self.channel.prefix}: the generation failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"shm {self.channel.prefix}: {written} of {nbytes} bytes written within "
                                   f"{self.channel.timeout}")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
        return min(written, nbytes)

    @override
    def _stop_serving(self) -> None:
        """Every reader has opened the segment: unlink it (readers keep what they opened)."""
        self._unlink()

    @override
    def shutdown(self) -> None:
        self._unlink()
        super().shutdown()

    def _unlink(self) -> None:
        """Done with the segment: a segment made ahead goes back to its holder (kept for the next send), a new one is
        unlinked."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and self.segment is not None:
            self.segment.give_back(prepared)
        elif self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path = None

    def _discard(self) -> None:
        """Writing failed: remove the segment, the one made ahead included."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and self.segment is not None:
            self.segment.discard(prepared)
        self._unlink()


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


def _create_segment(path: Path, nbytes: int) -> int:
    """The new segment file, ``nbytes`` long (a hole until written), open for writing."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as error:
        raise TransportUnavailable(f"cannot create {path}: {error}") from error
    try:
        os.ftruncate(fd, nbytes)
    except OSError as error:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise TransportUnavailable(f"cannot size {path} to {nbytes} bytes: {error}") from error
    return fd


def _write_segment(fd: int, path: Path, tensors: list[torch.Tensor], layout: PackedLayout, places: ArenaLayout,
                   progress: Callable[[int], None]) -> None:
    """Write the arena with ``pwrite`` in offset order, reporting every ``STREAM_CHUNK`` bytes to ``progress`` (the
    bytes from the arena's start now written; padding counts as written: it reads as zeros).

    Whole pages written into tmpfs are allocated without being zeroed first, and nothing is mapped into this process:
    the former ``posix_fallocate`` + ``MAP_POPULATE`` + copy zeroed and mapped every page, then copied (309 MB on the
    2-core box, warm: 106 ms against 308 ms). A full tmpfs fails the write (ENOSPC: :class:`TransportUnavailable`
    here, never a SIGBUS in a reader later).
    """
    reported = 0
    try:
        for offset, data in sorted(_arena_pieces(tensors, layout, places), key=lambda piece: piece[0]):
            for chunk_offset, chunk in _chunks(data, offset):
                _pwrite_all(fd, chunk, chunk_offset)
                end = chunk_offset + chunk.numel()
                if end - reported >= STREAM_CHUNK:
                    progress(end - reported)
                    reported = end
    except OSError as error:
        raise TransportUnavailable(f"cannot write {places.nbytes} bytes to {path}: {error}") from error
    progress(places.nbytes - reported)


def _chunks(data: torch.Tensor, offset: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``data`` (uint8) in pieces of at most ``STREAM_CHUNK`` bytes, with their arena offsets."""
    for start in range(0, data.numel(), STREAM_CHUNK):
        yield offset + start, data[start : start + STREAM_CHUNK]


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


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from the segment at ``offset`` (``preadv``)."""
    while view.nbytes:
        count = os.preadv(fd, [view[:_MAX_IO]], offset)
        if count == 0:
            raise RuntimeError(f"shared-memory segment ended {view.nbytes} bytes early")
        view, offset = view[count:], offset + count


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


def _stays_on_cpu(layout: PackedLayout, device_for: DeviceFor) -> bool:
    """Whether every buffer of the state lives on this reader's CPU (then it can be read into memory of its own)."""
    return all(torch.device(device_for(key.rpartition(":")[0])).type == "cpu" for key in layout.buffer_numels)


def _local_tensors(layout: PackedLayout, pieces: list[ReceivePiece], local: torch.Tensor,
                   own: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The received tensors in the source's order: the reader's own ones, the others typed views of ``local``."""
    tensors = [own.get(index) for index in range(len(layout.specs))]
    for piece in pieces:
        if piece.local_offset is not None:
            tensors[piece.index] = _typed_view(local[piece.local_offset : piece.local_offset + piece.nbytes],
                                               layout.specs[piece.index])
    for index, spec in enumerate(layout.specs):
        if tensors[index] is None:  # empty
            tensors[index] = torch.empty(spec.shape, dtype=dtype_from_str(spec.dtype))
    return tensors  # type: ignore[return-value]


def _typed_view(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return as_received(with_own_storage(data).view(dtype_from_str(spec.dtype)).view(spec.shape), spec)


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
