"""Memory a joiner receives its state into: tensors of its own, and bytes it faulted in while it warmed up.

A joiner already holds a model of the right shapes, built and touched during its warm-up; its parameters and buffers
can take the source's bytes directly (:attr:`ReceiveInto.destinations`), so nothing is allocated for them in the
pause and loading them afterwards copies nothing (``Tensor.copy_`` of a tensor onto itself returns at once). What it
has no tensor for yet (optimizer moments, created at the first step) lands in memory faulted in ahead of time
(:class:`PrefaultedMemory`, sized from what rank 0 publishes at each generation's first coordination) instead of
freshly allocated memory touched page by page while the stayers wait. :func:`receive_pieces` says where each byte of
the source's arena goes. Pure torch: no process group.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_elan.replication.packing import ArenaLayout, PackedLayout, TensorRef, dtype_from_str, split_tensors

log = logging.getLogger(__name__)

__all__ = [
    "PrefaultedMemory",
    "ReceiveInto",
    "ReceivePiece",
    "destinations_by_name",
    "populated",
    "receive_pieces",
    "tensor_nbytes",
    "usable_destinations",
]

LOCAL_ALIGN = 64  # bytes: each tensor received into local memory starts on this boundary
SPARE_SLACK_BYTES = 1 << 20
"""A joiner faults in this much more than rank 0 published (alignment; a state that grew a little). The tensors
received there share one storage, which ``torch.save`` writes whole: a joiner's checkpoint carries at most this much
more."""

Destinations = Callable[[Any], Mapping[int, torch.Tensor]]


def _no_destinations(cpu_state: Any) -> Mapping[int, torch.Tensor]:
    return {}


@dataclass
class ReceiveInto:
    """What a reader offers to receive into: its own tensors (by the index of the source's tensor, given the CPU
    state the header carries) and pre-faulted memory for the rest. A transport may ignore either."""

    destinations: Destinations = _no_destinations
    spare: PrefaultedMemory | None = None


def populated(nbytes: int) -> torch.Tensor:
    """``nbytes`` of this process's memory (uint8), faulted in by one ``MAP_POPULATE`` (anonymous, private) rather than
    page by page later; the tensor holds the mapping, which is unmapped when the last view of it is gone."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class PrefaultedMemory:
    """Bytes faulted in ahead of a transfer, in a thread (the joiner's warm-up and wait go on), taken once by the
    transfer that fits in them. The size may not be known yet (``size`` returns None): it is asked again every
    ``poll_s`` until it is, or until the transfer comes first (then it allocates as it would have)."""

    def __init__(self, size: Callable[[], int | None], poll_s: float = 0.2) -> None:
        self.nbytes: int | None = None
        self._size, self._poll_s = size, poll_s
        self._memory: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._done = threading.Event()
        threading.Thread(target=self._run, name="elan-prefault", daemon=True).start()

    @classmethod
    def fault_in(cls, published_nbytes: int) -> PrefaultedMemory:
        """Start faulting in room for ``published_nbytes`` (plus slack) now."""
        return cls(lambda: published_nbytes)

    def _run(self) -> None:
        try:
            while (nbytes := self._size()) is None:
                if self._closed:
                    return
                time.sleep(self._poll_s)
            with self._lock:
                if self._closed:
                    return
                self.nbytes = nbytes + SPARE_SLACK_BYTES
            memory = populated(self.nbytes)
            with self._lock:
                self._memory = None if self._closed else memory
        except Exception as error:  # no memory for it, the store went away: the transfer allocates as before
            log.warning("cannot fault in memory ahead of the state transfer: %s", error)
        finally:
            self._done.set()

    def wait(self) -> None:
        """Until the memory is faulted in (or could not be)."""
        self._done.wait()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The first ``nbytes`` of the memory (once), or None if its size is still unknown, it is too small, taken
        already or unavailable; waits while it is being faulted in."""
        with self._lock:
            self._closed, faulting = True, self.nbytes is not None
        if not faulting:
            return None
        self._done.wait()
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is None or nbytes > memory.numel():
            if memory is not None:
                log.info("state of %d bytes outgrew the %d bytes faulted in ahead: allocating", nbytes, memory.numel())
            return None
        return memory[:nbytes]


@dataclass(frozen=True)
class ReceivePiece:
    """Tensor ``index``'s ``nbytes`` at ``arena_offset`` of the source's arena; ``local_offset`` is where they go in
    the reader's local memory, None when they go straight into the reader's own tensor."""

    index: int
    arena_offset: int
    nbytes: int
    local_offset: int | None


def receive_pieces(
    layout: PackedLayout, places: ArenaLayout, own: set[int]
) -> tuple[list[ReceivePiece], int]:
    """Every non-empty tensor's bytes in the order of the arena, and the local memory the ones not in ``own`` need
    (packed one after another, each aligned)."""
    pieces, local = [], 0
    for index, spec in enumerate(layout.specs):
        itemsize = dtype_from_str(spec.dtype).itemsize
        nbytes = spec.numel * itemsize
        if not nbytes:
            continue
        offset = places.offsets[spec.key] + spec.offset * itemsize
        if index in own:
            pieces.append(ReceivePiece(index, offset, nbytes, None))
            continue
        local = -(-local // LOCAL_ALIGN) * LOCAL_ALIGN
        pieces.append(ReceivePiece(index, offset, nbytes, local))
        local += nbytes
    pieces.sort(key=lambda piece: piece.arena_offset)
    return pieces, local


def usable_destinations(
    layout: PackedLayout, offered: Mapping[int, torch.Tensor], local_device: Callable[[str], torch.device]
) -> dict[int, torch.Tensor]:
    """The offered tensors a CPU reader can receive into as they are: same dtype and shape as the source's, contiguous,
    in this process's CPU memory, for a tensor that stays on the CPU here; the rest are left out (they are received
    as before and loaded with a copy)."""
    usable = {}
    for index, tensor in offered.items():
        if not 0 <= index < len(layout.specs):
            continue
        spec = layout.specs[index]
        if (tensor.device.type == "cpu" and local_device(spec.device_type).type == "cpu"
                and str(tensor.dtype) == spec.dtype and tuple(tensor.shape) == spec.shape
                and tensor.is_contiguous() and not tensor.is_sparse):  # fmt: skip
            usable[index] = tensor
    return usable


def destinations_by_name(skeleton: Any, own: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """For a ``state_dict``-like skeleton (name -> :class:`TensorRef`) and this worker's own tensors of the same names:
    source tensor index -> own tensor (a name missing on either side is left out)."""
    if not isinstance(skeleton, Mapping):
        return {}
    return {ref.index: own[name] for name, ref in skeleton.items() if isinstance(ref, TensorRef) and name in own}


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (each tensor object once)."""
    _, tensors = split_tensors(obj)
    return sum(t.numel() * t.element_size() for t in tensors)
