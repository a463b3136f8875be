"""Epoch aggregates of members that leave or die, handed to one member that stays: the *heir*.

What a front-end accumulates over an epoch and synchronises across the members only at the epoch's end (Lightning's
``self.log(..., on_epoch=True, sync_dist=True)`` sums, torchmetrics states) lives in each process. The epoch's value
is the reduction over the members of the moment, so a member that leaves mid-epoch would take its part away. Here each
member records its aggregates in the generation's vote store (a few hundred bytes for scalar metrics), and at an
adjustment or a recovery the heir — the first stayer of the new generation, else its first member — adds the departed
members' records to its own: the epoch's reduction then covers every sample trained in it, as in a static run. A
joiner starts empty (the members hold the epoch so far).

A member records when it enters a generation, at every batch boundary where its step stands, and before each commit
vote (the step's aggregates are complete then, unless it logs after its optimizer step). It keeps two records, in two
slots: the last one of a step that stood, and the one written before the vote on the next step. A member that dies
after its step stood but before its next boundary has the record of that step (written before the vote), and one whose
step was discarded the record of the step before; the heir takes the record of the step that stands for the survivors.
A member whose aggregates grew after a vote (a value logged in ``on_train_batch_end``) marks its later records written
before a vote as *partial*: the heir taking one says that its part of that step may lack those values.

A record is a front-end's dict of tensors (and lists of tensors) in a plain form — a JSON header that describes each
tensor (dtype, shape, where its bytes lie) and the tensors' raw bytes — written at every step, so it is made in tens of
microseconds (``torch.save`` took ~0.3–0.9 ms), and nothing that arrives through the store is unpickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_elan.elastic.frontend import FrontEnd
    from lightning_elan.protocol.contract import AdjustmentPlan

log = logging.getLogger(__name__)

__all__ = ["SLOTS", "AggregateHandover", "AggregateRecord", "Inheritance", "heir_of", "read_records", "record_key",
           "write_record"]

SLOTS = (0, 1)
"""A member's two records in a generation: its last of a step that stood, and its last written before a vote."""


def record_key(generation: int, worker_id: str, slot: int = 0) -> str:
    """Where ``worker_id`` keeps its record in ``slot`` while a member of ``generation``."""
    return f"elan/gen{generation}/aggregates/{worker_id}/{slot}"


@dataclass(frozen=True)
class AggregateRecord:
    """One member's epoch aggregates after ``step`` optimizer steps, in ``epoch``. ``partial``: written before the
    vote on ``step`` by a member that logs after its optimizer steps: what it logged after the vote is not in it."""

    worker_id: str
    step: int
    epoch: int | None
    aggregates: dict[str, Any]
    partial: bool = False

    def to_bytes(self) -> bytes:
        blobs: list[bytes] = []
        tree = _described(self.aggregates, blobs)
        header = json.dumps({"worker": self.worker_id, "step": self.step, "epoch": self.epoch, "partial": self.partial,
                             "aggregates": tree})
        encoded = header.encode()
        return len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> AggregateRecord:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        blob = memoryview(data)[8 + size :]
        aggregates = _rebuilt(header["aggregates"], blob)
        return cls(str(header["worker"]), int(header["step"]), header["epoch"], dict(aggregates),
                   bool(header.get("partial", False)))


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


def write_record(store: dist.Store, generation: int, record: AggregateRecord, slot: int = 0) -> None:
    store.set(record_key(generation, record.worker_id, slot), record.to_bytes())


@dataclass(frozen=True)
class Inheritance:
    """What the heir of a recovery plan took: the ``dead`` members' parts, as it was to enter ``generation``."""

    generation: int
    dead: tuple[str, ...]


def read_records(store: dist.Store, generation: int, departed: list[str], step: int, epoch: int | None,
                 earlier: Sequence[int] = (),
                 inherited: Mapping[str, Sequence[Inheritance]] | None = None) -> list[AggregateRecord]:
    """The departed members' records of ``generation`` that belong to the heir's ``epoch`` at ``step``.

    A member with none there (it died entering ``generation``, a recovery's that failed as it formed) has its records
    of the newest of the ``earlier`` generations (newest first) that holds any read instead; and if it was the heir of
    an earlier plan of the recovery (``inherited``) and wrote no record from that plan's generation on, its records
    lack what it took: the members it took from count on their own.

    Of a member's two records the one of ``step`` is taken (one that stood before one written before its vote). A
    record of ``step`` in an earlier epoch holds nothing of this one (its step in this epoch was discarded): nothing is
    taken. With no record of ``step``, the newest earlier one is taken with a warning (the epoch's value then lacks
    that member's part of the steps after it), or, of an earlier epoch, left out with that warning. A record of a
    later step only, or none (a member that had logged nothing), gives nothing."""
    records, pending = [], list(departed)
    while pending:
        worker_id = pending.pop(0)
        written_in, slots = _newest_slots(store, (generation, *earlier), worker_id)
        pending += _taken_since(worker_id, written_in, inherited or {})
        record = _chosen(worker_id, slots, step, epoch)
        if record is not None:
            records.append(record)
    return records


def _newest_slots(store: dist.Store, generations: Sequence[int],
                  worker_id: str) -> tuple[int | None, list[AggregateRecord]]:
    """``worker_id``'s records of the first of ``generations`` in which it wrote any, and that generation."""
    for generation in generations:
        records = _read_slots(store, generation, worker_id)
        if records:
            return generation, records
    return None, []


def _taken_since(heir: str, written_in: int | None, inherited: Mapping[str, Sequence[Inheritance]]) -> list[str]:
    """The members whose parts ``heir`` took as it was to enter a generation after ``written_in``, its newest record's
    (so its record lacks them)."""
    return [dead for taken in inherited.get(heir, ()) if written_in is None or written_in < taken.generation
            for dead in taken.dead]


def _read_slots(store: dist.Store, generation: int, worker_id: str) -> list[AggregateRecord]:
    return [record for slot in SLOTS if (record := _read(store, generation, worker_id, slot)) is not None]


def _chosen(worker_id: str, records: list[AggregateRecord], step: int, epoch: int | None) -> AggregateRecord | None:
    """Which of ``worker_id``'s records the heir at ``step`` of ``epoch`` takes (see :func:`read_records`)."""
    exact = sorted((record for record in records if record.step == step), key=lambda record: record.partial)
    if exact:
        return _of_epoch(exact[0], epoch)
    earlier = [record for record in records if record.step < step]
    if not earlier:
        log.debug("no epoch aggregates of %s for epoch %s, step %d", worker_id, epoch, step)
        return None
    record = max(earlier, key=lambda record: record.step)
    if _before_epoch(record, epoch):
        log.warning("the epoch aggregates of %s are from step %d of epoch %d, not step %d of epoch %d: this "
                    "epoch's logged values lack its part of the steps between", worker_id, record.step,
                    record.epoch, step, epoch)
        return None
    if record.epoch != epoch:
        log.debug("no epoch aggregates of %s for epoch %s, step %d", worker_id, epoch, step)
        return None
    log.warning("the epoch aggregates of %s are from step %d, not %d: this epoch's logged values lack its part of "
                "the steps between", worker_id, record.step, step)
    return record


def _of_epoch(record: AggregateRecord, epoch: int | None) -> AggregateRecord | None:
    """``record`` of the heir's step: nothing when it is of another epoch; a partial one is taken with a warning."""
    if record.epoch != epoch:
        log.debug("the epoch aggregates of %s at step %d are of epoch %s, not %s: nothing of this epoch",
                  record.worker_id, record.step, record.epoch, epoch)
        return None
    if record.partial:
        log.warning("the epoch aggregates of %s are from before its step %d stood: this epoch's logged values lack "
                    "what it logged after that optimizer step (in on_train_batch_end)", record.worker_id, record.step)
    return record


def _before_epoch(record: AggregateRecord, epoch: int | None) -> bool:
    """Whether ``record`` is of an epoch before ``epoch``."""
    return record.epoch is not None and epoch is not None and record.epoch < epoch


def _read(store: dist.Store, generation: int, worker_id: str, slot: int) -> AggregateRecord | None:
    key = record_key(generation, worker_id, slot)
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
    """One worker's side of the handover: its records (see the module's docstring), and, when it is the heir of an
    adjustment or a recovery, the departed members' records added to its own aggregates.

    A user's metric state never breaks training: a state the record cannot hold stops the recording (one warning), and
    an error while the heir adds a departed member's part is a warning.
    """

    def __init__(self, worker_id: str, frontend: FrontEnd) -> None:
        self._worker_id = worker_id
        self._frontend = frontend
        self._recording = True
        self._generation: int | None = None  # of the slots below
        self._written: dict[int, tuple[int, bytes]] = {}  # slot -> (step, the record's bytes) written there
        self._stood: int | None = None  # the slot of the record of the last step that stood
        self._voted: tuple[int, bytes] | None = None  # the step last voted on and its aggregates, as recorded
        self._late_values = False  # its aggregates grew after a vote: its records before a vote are partial
        self._taken: set[str] = set()  # the departed workers whose aggregates this heir has added to its own

    def record(self, store: dist.Store, generation: int, step: int, epoch: int | None) -> None:
        """``step`` stands (a batch boundary, a generation entered): write this member's aggregates so far as its
        record of ``generation`` (nothing while it has none)."""
        made = self._made(generation, step, epoch)
        if made is None:
            return
        _, data = made
        slot = self._slot_of_stood(step, data)
        self._write(store, generation, slot, step, data)
        self._stood = slot

    def record_before_vote(self, store: dist.Store, generation: int, step: int, epoch: int | None) -> None:
        """Before the commit vote on ``step``: this member's aggregates with that step's, beside its record of the step
        before (the vote may discard ``step``). A store that fails here is left to the vote to meet."""
        made = self._made(generation, step, epoch)
        if made is None:
            return
        record, data = made
        self._voted = (step, data)
        if self._late_values:
            data = replace(record, partial=True).to_bytes()
        try:
            self._write(store, generation, self._unstood_slot(), step, data)
        except (RuntimeError, OSError) as error:  # the vote store died with its host (an etcd job's rank 0)
            log.debug("worker %s could not record its epoch aggregates before the vote on step %d: %s",
                      self._worker_id, step, error)

    def take(self, plan: AdjustmentPlan, departed: list[str], store: dist.Store | None, step: int,
             epoch: int | None, generations: Sequence[int] = (),
             inherited: Mapping[str, Sequence[Inheritance]] | None = None) -> None:
        """As the heir of ``plan``: add the departed members' records of the previous generation to its own — or,
        given ``generations`` (newest first), of the newest of them in which each wrote any (see
        :func:`read_records`)."""
        departed = [worker for worker in departed if worker not in self._taken]  # a plan cut short, then its recovery
        if not departed or store is None or heir_of(plan) != self._worker_id:
            return
        newest, *earlier = generations or (plan.previous_generation,)
        records = read_records(store, newest, departed, step, epoch, earlier, inherited)
        if records:
            self._absorb(records)
            self._taken.update(record.worker_id for record in records)

    def _made(self, generation: int, step: int, epoch: int | None) -> tuple[AggregateRecord, bytes] | None:
        """This member's record now and its bytes; None when it records nothing (it stopped, or it has logged nothing
        and wrote no record in this generation)."""
        if not self._recording:
            return None
        if generation != self._generation:
            self._generation, self._written, self._stood, self._voted = generation, {}, None, None
        try:
            aggregates = self._frontend.epoch_aggregates() or {}
            if not aggregates and not self._written:
                return None
            record = AggregateRecord(self._worker_id, step, epoch, aggregates)
            return record, record.to_bytes()
        except Exception as error:  # a user's metric state: whatever it raises, training goes on
            self._recording = False
            log.warning("worker %s stops recording its epoch aggregates (%s: %s): if it leaves or dies, this epoch's "
                        "logged values lack its part", self._worker_id, type(error).__name__, error)
            return None

    def _unstood_slot(self) -> int:
        return SLOTS[0] if self._stood is None else SLOTS[1 - self._stood]

    def _slot_of_stood(self, step: int, data: bytes) -> int:
        """Where the record of ``step``, which stands, goes: over the one written before its vote, else over this
        member's record of the same step, else in the slot that is not the last stood one's."""
        if self._voted is not None and self._voted[0] == step:
            if self._voted[1] != data and not self._late_values:
                self._late_values = True
                log.debug("worker %s logs after its optimizer step: its records before a vote are partial",
                          self._worker_id)
            self._voted = None
            return self._unstood_slot()
        if self._stood is not None and self._written[self._stood][0] == step:
            return self._stood
        return self._unstood_slot()

    def _write(self, store: dist.Store, generation: int, slot: int, step: int, data: bytes) -> None:
        if self._written.get(slot) != (step, data):
            store.set(record_key(generation, self._worker_id, slot), data)
            self._written[slot] = (step, data)

    def _absorb(self, records: list[AggregateRecord]) -> None:
        names = ", ".join(record.worker_id for record in records)
        try:
            self._frontend.absorb_epoch_aggregates([record.aggregates for record in records])
        except Exception as error:  # a user's metric state: the adjustment goes on
            log.warning("worker %s could not add the epoch aggregates of %s (%s: %s): this epoch's logged values lack "
                        "their part", self._worker_id, names, type(error).__name__, error)
            return
        log.info("worker %s took the epoch aggregates of %s", self._worker_id, names)
