"""The shared-memory transport filling a real reader process's own tensors and pre-faulted memory as the source
writes, bit-exact (which bytes go where: ``tests/unit/test_reception.py``)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.replication.reception import PrefaultedMemory, ReceiveInto
from lightning_elan.replication.transports import Channel, ShmTransport
from tests.unit.test_reception import CPU, CTX, TIMEOUT, own_tensors, state

# ------------------------------------------------------------------ shared memory, a real reader process


def _receive_into_own(port: int, prefix: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    own = own_tensors()
    spare = PrefaultedMemory.fault_in(sum(t.numel() * t.element_size() for t in state()))
    spare.wait()
    start = spare._memory.data_ptr()  # where the memory faulted in ahead lies
    into = ReceiveInto(lambda cpu_state: own if cpu_state["offer"] else {}, spare)
    got = ShmTransport(Channel(store, prefix, TIMEOUT)).receive(0, lambda _: CPU, into)
    same_objects = sorted(i for i, t in enumerate(got.tensors) if i in own and t is own[i])
    in_spare = [start <= got.tensors[i].data_ptr() < start + spare.nbytes for i in (2, 3, 4, 5, 7)]
    torch.save(got.tensors, io.BytesIO())  # float32, float64 and int64 tensors from one allocation: a checkpoint
    Path(out).write_bytes(pickle.dumps((got.tensors, same_objects, in_spare, got.nbytes)))


def test_a_reader_receives_into_its_own_tensors_and_its_prefaulted_memory(store, tmp_path, monkeypatch) -> None:
    """Parameters that fit are filled in place (the very tensors offered come back), the rest lands in the memory
    faulted in ahead; all bit-exact, read chunk by chunk while the source writes (1 KB chunks)."""
    from lightning_elan.replication.transports import shm as shm_module

    monkeypatch.setattr(shm_module, "STREAM_CHUNK", 1024)
    reader = CTX.Process(target=_receive_into_own, args=(store.port, "own", str(tmp_path / "got.pkl")))
    reader.start()
    tensors = state()
    source = ShmTransport(Channel(store, "own", TIMEOUT), shm_dir=tmp_path)
    sent = source.send({"offer": True}, tensors, readers=1)
    source.disallow()
    reader.join(120)
    assert reader.exitcode == 0
    got, same_objects, in_spare, received = pickle.loads((tmp_path / "got.pkl").read_bytes())
    assert same_objects == [0, 1, 8]
    assert in_spare == [True] * 5  # every other tensor lies in the pre-faulted memory (and torch.save takes them)
    assert received == sent
    for g, w in zip(got, tensors, strict=True):
        assert (g.dtype, g.shape) == (w.dtype, w.shape) and torch.equal(g, w)
    source.shutdown()


def _plain_receive(port: int, prefix: str, out: str, into: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    got = ShmTransport(Channel(store, prefix, TIMEOUT)).receive(0, lambda _: CPU, into)
    Path(out).write_bytes(pickle.dumps(got.tensors))


def test_with_nothing_offered_the_reader_allocates_as_before(store, tmp_path) -> None:
    reader = CTX.Process(target=_plain_receive, args=(store.port, "plain", str(tmp_path / "got.pkl"), None))
    reader.start()
    tensors = state()
    source = ShmTransport(Channel(store, "plain", TIMEOUT), shm_dir=tmp_path)
    source.send({"offer": False}, tensors, readers=1)
    source.disallow()
    reader.join(120)
    assert reader.exitcode == 0
    got = pickle.loads((tmp_path / "got.pkl").read_bytes())
    assert all(torch.equal(g, w) for g, w in zip(got, tensors, strict=True))
    source.shutdown()
