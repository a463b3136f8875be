"""Epoch aggregates of members that leave or die, handed to one member that stays: the *heir*.

What a front-end accumulates over an epoch and synchronises across the members only at the epoch's end (Lightning's
``self.log(..., on_epoch=True, sync_dist=True)`` sums, torchmetrics states) lives in each process. The epoch's value
is the reduction over the members of the moment, so a member that leaves mid-epoch would take its part away. Here each
member records its aggregates in the generation's vote store at every batch boundary where its step is closed (a few
hundred bytes for scalar metrics), and at an adjustment or a recovery the heir — the first stayer of the new
generation, else its first member — adds the departed members' records to its own: the epoch's reduction then covers
every sample trained in it, as in a static run. A joiner starts empty (the members hold the epoch so far).

A record is a front-end's dict of tensors (and lists of tensors) in a plain form — a JSON header that describes each
tensor (dtype, shape, where its bytes lie) and the tensors' raw bytes — written at every step, so it is made in tens of
microseconds (``torch.save`` took ~0.3–0.9 ms), and nothing that arrives through the store is unpickled.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_elan.elastic.frontend import FrontEnd
    from lightning_elan.protocol.contract import AdjustmentPlan

log = logging.getLogger(__name__)

__all__ = ["AggregateHandover", "AggregateRecord", "heir_of", "read_records", "record_key", "write_record"]


def record_key(generation: int, worker_id: str) -> str:
    """Where ``worker_id`` records its aggregates while a member of ``generation``."""
    return f"elan/gen{generation}/aggregates/{worker_id}"


@dataclass(frozen=True)
class AggregateRecord:
    """One member's epoch aggregates after ``step`` optimizer steps, in ``epoch``."""

    worker_id: str
    step: int
    epoch: int | None
    aggregates: dict[str, Any]

    def to_bytes(self) -> bytes:
        blobs: list[bytes] = []
        tree = _described(self.aggregates, blobs)
        header = json.dumps({"worker": self.worker_id, "step": self.step, "epoch": self.epoch, "aggregates": tree})
        encoded = header.encode()
        return len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> AggregateRecord:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        blob = memoryview(data)[8 + size :]
        aggregates = _rebuilt(header["aggregates"], blob)
        return cls(str(header["worker"]), int(header["step"]), header["epoch"], dict(aggregates))


_TENSOR = "__tensor__"


def _described(value: Any, blobs: list[bytes]) -> Any:
    """``value`` with each tensor replaced by ``{_TENSOR: [dtype, shape, offset, nbytes]}`` and its bytes appended."""
    if isinstance(value, torch.Tensor):
        data = _raw_bytes(value)
        offset = sum(len(blob) for blob in blobs)
        blobs.append(data)
        return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape), offset, len(data)]}
    if isinstance(value, dict):
        return {str(key): _described(item, blobs) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_described(item, blobs) for item in value]
    return value


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):  # no numpy dtype: as bytes
        return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return tensor.numpy().tobytes()  # C order, whatever the strides


def _rebuilt(value: Any, blob: memoryview) -> Any:
    if isinstance(value, dict) and _TENSOR in value:
        dtype_name, shape, offset, nbytes = value[_TENSOR]
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype in an aggregate record: {dtype_name!r}")
        raw = torch.frombuffer(bytearray(blob[offset : offset + nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)
    if isinstance(value, dict):
        return {key: _rebuilt(item, blob) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuilt(item, blob) for item in value]
    return value


def heir_of(plan: AdjustmentPlan) -> str | None:
    """Who takes the departed members' aggregates: the first stayer of the new generation, else its first member."""
    stayers = plan.stayers
    if stayers:
        return stayers[0]
    return plan.members[0] if plan.members else None


def write_record(store: dist.Store, generation: int, record: AggregateRecord) -> None:
    store.set(record_key(generation, record.worker_id), record.to_bytes())


def read_records(store: dist.Store, generation: int, departed: list[str], step: int,
                 epoch: int | None) -> list[AggregateRecord]:
    """The departed members' records of ``generation`` that belong to the heir's ``epoch`` at ``step``.

    A record of an earlier step (a member that died after its last step stood, before its next boundary) is taken
    with a warning: the epoch's value then lacks that member's part of the steps after it. A record of the previous
    epoch's last step (it died so in the epoch's first batch) holds nothing of this epoch: it is left out with that
    warning. A record of another epoch, a later step, or none (a member that trained no step of this generation) is
    left out."""
    records = []
    for worker_id in departed:
        record = _read(store, generation, worker_id)
        if record is not None and _before_epoch(record, epoch) and record.step < step:
            log.warning("the epoch aggregates of %s are from step %d of epoch %d, not step %d of epoch %d: this "
                        "epoch's logged values lack its part of the steps between", worker_id, record.step,
                        record.epoch, step, epoch)
            continue
        if record is None or record.epoch != epoch or record.step > step:
            log.debug("no epoch aggregates of %s for epoch %s, step %d", worker_id, epoch, step)
            continue
        if record.step < step:
            log.warning("the epoch aggregates of %s are from step %d, not %d: this epoch's logged values lack its "
                        "part of the steps between", worker_id, record.step, step)
        records.append(record)
    return records


def _before_epoch(record: AggregateRecord, epoch: int | None) -> bool:
    """Whether ``record`` is of an epoch before ``epoch``."""
    return record.epoch is not None and epoch is not None and record.epoch < epoch


def _read(store: dist.Store, generation: int, worker_id: str) -> AggregateRecord | None:
    key = record_key(generation, worker_id)
    try:
        if not store.check([key]):
            return None
        return AggregateRecord.from_bytes(store.get(key))
    except (RuntimeError, OSError) as error:  # the store died with its host (an etcd job's rank 0 fast store)
        log.warning("the epoch aggregates of %s could not be read: %s; this epoch's logged values lack its part",
                    worker_id, error)
        return None
    except (ValueError, KeyError, TypeError, IndexError) as error:  # not a record (torn, or written by another tool)
        log.warning("the epoch aggregates of %s are not a record (%s); this epoch's logged values lack its part",
                    worker_id, error)
        return None


class AggregateHandover:
    """One worker's side of the handover: its record at every boundary where its step stands, and, when it is the
    heir of an adjustment or a recovery, the departed members' records added to its own aggregates.

    A user's metric state never breaks training: a state the record cannot hold stops the recording (one warning), and
    an error while the heir adds a departed member's part is a warning.
    """

    def __init__(self, worker_id: str, frontend: FrontEnd) -> None:
        self._worker_id = worker_id
        self._frontend = frontend
        self._recording = True

    def record(self, store: dist.Store, generation: int, step: int, epoch: int | None) -> None:
        """Write this member's aggregates so far as its record of ``generation`` (nothing when it has none)."""
        if not self._recording:
            return
        data = self._record(step, epoch)
        if data is not None:
            store.set(record_key(generation, self._worker_id), data)

    def take(self, plan: AdjustmentPlan, departed: list[str], store: dist.Store | None, step: int,
             epoch: int | None) -> None:
        """As the heir of ``plan``: add the departed members' records of the previous generation to its own."""
        if not departed or store is None or heir_of(plan) != self._worker_id:
            return
        records = read_records(store, plan.previous_generation, departed, step, epoch)
        if records:
            self._absorb(records)

    def _record(self, step: int, epoch: int | None) -> bytes | None:
        try:
            aggregates = self._frontend.epoch_aggregates()
            return AggregateRecord(self._worker_id, step, epoch, aggregates).to_bytes() if aggregates else None
        except Exception as error:  # a user's metric state: whatever it raises, training goes on
            self._recording = False
            log.warning("worker %s stops recording its epoch aggregates (%s: %s): if it leaves or dies, this epoch's "
                        "logged values lack its part", self._worker_id, type(error).__name__, error)
            return None

    def _absorb(self, records: list[AggregateRecord]) -> None:
        names = ", ".join(record.worker_id for record in records)
        try:
            self._frontend.absorb_epoch_aggregates([record.aggregates for record in records])
        except Exception as error:  # a user's metric state: the adjustment goes on
            log.warning("worker %s could not add the epoch aggregates of %s (%s: %s): this epoch's logged values lack "
                        "their part", self._worker_id, names, type(error).__name__, error)
            return
        log.info("worker %s took the epoch aggregates of %s", self._worker_id, names)
