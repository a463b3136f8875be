"""Same-host transports through the ``StateTransport`` interface: shared memory between real processes on this host
(CPU), bit-exact; CUDA IPC's store protocol with a stand-in device; what each leaves in the store (nothing)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_elan.replication.cuda import ipc
from lightning_elan.replication.planner import plan_transfers
from lightning_elan.replication.topology import WorkerTopology, detect
from lightning_elan.replication.transports import (
    Channel,
    CudaIpcTransport,
    ShmTransport,
    TransportUnavailable,
    transport_for,
)
from lightning_elan.replication.transports.shm import remove_stale_segments

TIMEOUT = datetime.timedelta(seconds=60)
CTX = mp.get_context("spawn")
CPU = torch.device("cpu")


def make_state(seed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Mixed dtypes, odd sizes, a 0-d, an empty and a non-contiguous tensor, NaNs; plus CPU-side state."""
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(7, 13, generator=g),
        torch.randn(1, generator=g, dtype=torch.float64),
        torch.randint(-(2**40), 2**40, (3, 5, 7), generator=g),
        torch.randn(1001, generator=g).to(torch.bfloat16),
        torch.randn(17, generator=g).half(),
        torch.rand(33, generator=g) > 0.5,
        torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.randn(6, 10, generator=g).t(),  # non-contiguous
        torch.randn(5, generator=g, dtype=torch.complex64),
        torch.full((3,), float("nan")),
    ]
    cpu_state = {"step": 123, "rng": g.get_state(), "position": [4, 5], "name": "ü"}
    return cpu_state, tensors


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape))
        assert bits(g) == bits(w)


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


# ------------------------------------------------------------------ child process bodies (spawned)


def _receive(port: int, prefix: str, reader: int, out: str) -> None:
    got = ShmTransport(Channel(client(port), prefix, TIMEOUT)).receive(reader, lambda _: CPU)
    Path(out).write_bytes(pickle.dumps((got.cpu_state, got.tensors, got.nbytes)))


def run(procs: list[mp.Process], started: bool = False) -> None:
    for p in procs:
        if not started:
            p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), codes


def segments(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.glob("elan-*"))


def shm(store: dist.Store, prefix: str, shm_dir: Path | None = None, **kwargs: Any) -> ShmTransport:
    return ShmTransport(Channel(store, prefix, TIMEOUT), shm_dir=shm_dir, **kwargs)


# ------------------------------------------------------------------ shared memory


def test_one_source_two_readers_bit_equal_and_nothing_left(store: dist.TCPStore, tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    keys_before = set(store.list_keys())
    readers = [CTX.Process(target=_receive, args=(store.port, "t1", i, str(tmp_path / f"r{i}"))) for i in range(2)]
    for p in readers:
        p.start()  # they wait for the header

    source = shm(store, "t1", shm_dir)
    sent = source.send(*make_state(7), readers=2)
    run(readers, started=True)
    source.disallow()
    assert segments(shm_dir) == []  # unlinked once both opened it
    source.shutdown()

    want_state, want = make_state(7)
    for i in range(2):
        cpu_state, tensors, received = pickle.loads((tmp_path / f"r{i}").read_bytes())
        assert_bit_equal(tensors, want)
        assert cpu_state["step"] == 123 and cpu_state["name"] == "ü"
        assert torch.equal(cpu_state["rng"], want_state["rng"])
        assert received == sent
    assert set(store.list_keys()) == keys_before  # header and acknowledgements deleted


def test_grow_two_to_four_each_joiner_copies_from_its_own_stayer(store: dist.TCPStore, tmp_path: Path) -> None:
    # the planner, fed this host's real topology, pairs each joiner with a distinct stayer over shared memory
    here = detect("cpu")
    plan = plan_transfers({"w0": here, "w1": here}, {"w2": here, "w3": here})
    assert {t.source for t in plan} == {"w0", "w1"}
    assert {t.transport for t in plan} == {"shm"} and {t.wave for t in plan} == {0}

    joiners = [CTX.Process(target=_receive, args=(store.port, f"g1/{t.source}", 0, str(tmp_path / t.joiner)))
               for t in plan]  # fmt: skip
    sources = [transport_for("shm", Channel(store, f"g1/{s}", TIMEOUT)) for s in ("w0", "w1")]
    for source in sources:  # the two stayers publish at once (send returns without waiting)
        source.send(*make_state(5), readers=1)

    run(joiners)
    for source in sources:
        source.disallow()
        source.shutdown()

    want = make_state(5)[1]
    for joiner in ("w2", "w3"):
        assert_bit_equal(pickle.loads((tmp_path / joiner).read_bytes())[1], want)


def test_in_process_round_trip_and_unlink_after_disallow(store: dist.TCPStore, tmp_path: Path) -> None:
    cpu_state, tensors = make_state(3)
    source = shm(store, "p", tmp_path)
    sent = source.send(cpu_state, tensors, readers=1)
    assert source.path is not None and segments(tmp_path) == [source.path.name]

    got = shm(store, "p").receive(0, lambda _: CPU)
    source.disallow()
    source.shutdown()

    assert_bit_equal(got.tensors, tensors)
    assert got.nbytes == sent and got.cpu_state["position"] == [4, 5]
    assert segments(tmp_path) == []


def test_disallow_times_out_without_readers_and_still_unlinks(store: dist.TCPStore, tmp_path: Path) -> None:
    source = shm(store, "q", tmp_path)
    source.send({}, [torch.ones(3)], readers=1)
    with pytest.raises(TimeoutError, match="0 of 1 acknowledged"):
        source.disallow(datetime.timedelta(seconds=0.2))
    assert segments(tmp_path) == []
    source.shutdown()
    assert not store.check(["q/header"])


def test_no_shared_memory_directory_is_reported(store: dist.TCPStore, tmp_path: Path) -> None:
    with pytest.raises(TransportUnavailable):
        shm(store, "x", tmp_path / "missing").send({}, [torch.ones(3)], readers=1)


def test_empty_state(store: dist.TCPStore, tmp_path: Path) -> None:
    source = shm(store, "e", tmp_path)
    source.send({"only": "cpu"}, [], readers=1)
    got = shm(store, "e").receive(0, lambda _: CPU)
    source.disallow()
    source.shutdown()
    assert (got.cpu_state, got.tensors) == ({"only": "cpu"}, [])


def test_cpu_workers_of_this_host_are_l2_to_each_other() -> None:
    a, b = detect("cpu"), detect(None)
    assert isinstance(a, WorkerTopology) and a.host == os.uname().nodename
    assert plan_transfers({"a": a}, {"b": b})[0].level == 2


def test_zero_copy_tensors_are_private_copies_on_write(store: dist.TCPStore, tmp_path: Path) -> None:
    cpu_state, tensors = make_state(4)
    source = shm(store, "z", tmp_path)
    source.send(cpu_state, tensors, readers=3)

    first = shm(store, "z", zero_copy=True).receive(0, lambda _: CPU).tensors
    second = shm(store, "z", zero_copy=True).receive(1, lambda _: CPU).tensors
    copied = shm(store, "z").receive(2, lambda _: CPU).tensors
    source.disallow()
    source.shutdown()
    first[0].add_(1.0)  # a joiner trains on its tensors: only its own pages change

    assert_bit_equal(second, tensors)
    assert_bit_equal(copied, tensors)
    assert torch.equal(first[0], tensors[0] + 1.0)
    assert segments(tmp_path) == []


def test_a_fallback_reaches_the_readers(store: dist.TCPStore, tmp_path: Path) -> None:
    source = shm(store, "f", tmp_path / "missing")
    with pytest.raises(TransportUnavailable) as raised:
        source.send({}, [torch.ones(3)], readers=1)
    source.publish_fallback(str(raised.value))

    with pytest.raises(TransportUnavailable, match="uses the collective"):
        shm(store, "f").receive(0, lambda _: CPU)
    source.disallow()
    source.shutdown()
    assert not store.check(["f/header"])


def test_segments_left_by_a_crashed_source_are_removed_later(tmp_path: Path) -> None:
    stale, fresh = tmp_path / "elan-1-old", tmp_path / "elan-2-new"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (1, 1))

    assert remove_stale_segments(tmp_path) == [stale]
    assert segments(tmp_path) == ["elan-2-new"]


# ------------------------------------------------------------------ CUDA IPC with a stand-in device


class FakeMapping:
    """Stands in for a CUDA IPC mapping: the 'device memory' is the pickled arena itself."""

    opened: list[FakeMapping] = []

    def __init__(self, handle: Any, device: Any) -> None:
        self.arena, self.closed = handle.payload, False
        FakeMapping.opened.append(self)

    def copy_to(self, dst: torch.Tensor, offset: int = 0) -> None:
        dst.copy_(self.arena[offset : offset + dst.numel()])

    def close(self) -> None:
        self.closed = True


def test_ipc_protocol_with_a_stand_in_device(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA IPC transport's header/ack protocol and copies, run on CPU with the device calls replaced."""
    monkeypatch.setattr(ipc, "alloc_shareable", lambda n, d: torch.full((n,), 0xA5, dtype=torch.uint8))
    monkeypatch.setattr(ipc, "ipc_export", lambda a: ipc.IpcHandle("fake", a, a.numel(), 0))
    monkeypatch.setattr(ipc, "ipc_open", FakeMapping)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    keys_before = set(store.list_keys())
    cpu_state, tensors = make_state(9)
    channel = Channel(store, "ipc", TIMEOUT, torch.device("cuda", 0))

    source = CudaIpcTransport(channel)
    sent = source.send(cpu_state, tensors, readers=2)
    got = [CudaIpcTransport(channel).receive(i, lambda _: CPU) for i in range(2)]
    assert store.add("ipc/acks", 0) == 2
    source.disallow()
    source.shutdown()

    for received in got:
        assert_bit_equal(received.tensors, tensors)
        assert received.nbytes == sent and received.cpu_state["step"] == 123
    assert len(FakeMapping.opened) == 2 and all(m.closed for m in FakeMapping.opened)
    assert set(store.list_keys()) == keys_before


def test_ipc_on_a_cpu_device_is_unavailable(store: dist.TCPStore) -> None:
    with pytest.raises(TransportUnavailable, match="not a GPU"):
        CudaIpcTransport(Channel(store, "c", TIMEOUT)).send({}, [torch.ones(2)], readers=1)


def test_a_reader_copies_the_segment_while_the_source_writes_it(store, tmp_path, monkeypatch) -> None:
    """The header comes first; the reader follows the written-bytes count chunk by chunk (4 KB chunks here: many
    steps), starting before the source has written anything, and gets the state bit-exact."""
    from lightning_elan.replication.transports import shm as shm_module

    monkeypatch.setattr(shm_module, "STREAM_CHUNK", 4096)
    cpu_state, tensors = make_state(11)
    tensors = [*tensors, torch.randn(50_000)]  # 200 KB: dozens of chunks
    counts: list[int] = []
    real_add = store.add

    class CountingStore:  # the source's view of the store: records every count it publishes
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def add(self, key: str, value: int) -> int:
            if key.endswith("/written"):
                counts.append(value)
            return real_add(key, value)

    reader = CTX.Process(target=_receive, args=(store.port, "s", 0, str(tmp_path / "got.pkl")))
    reader.start()  # it waits for the header, then for the count
    source = ShmTransport(Channel(CountingStore(), "s", TIMEOUT), shm_dir=tmp_path)  # type: ignore[arg-type]
    source.send(cpu_state, tensors, readers=1)
    source.disallow()
    run([reader], started=True)
    got_cpu, got, _ = pickle.loads((tmp_path / "got.pkl").read_bytes())
    assert got_cpu["step"] == cpu_state["step"] and torch.equal(got_cpu["rng"], cpu_state["rng"])
    assert_bit_equal(got, tensors)
    assert len(counts) > 40 and all(count > 0 for count in counts)  # reported chunk by chunk
    source.shutdown()
    assert segments(tmp_path) == [] and not store.check(["s/written"])


def test_a_source_that_cannot_write_tells_its_readers_to_use_the_collective(store, tmp_path, monkeypatch) -> None:
    """A write that fails after the header was published (a full tmpfs) marks the count failed: the reader raises
    TransportUnavailable (then both sides use the collective), the segment is gone."""
    from lightning_elan.replication.transports import shm as shm_module

    def full(fd: int, data: torch.Tensor, offset: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_module, "_pwrite_all", full)
    source = shm(store, "n", tmp_path)
    with pytest.raises(TransportUnavailable, match="No space left"):
        source.send({}, [torch.ones(1000)], readers=1)
    with pytest.raises(TransportUnavailable, match="could not write the segment"):
        shm(store, "n").receive(0, lambda _: CPU)
    assert segments(tmp_path) == []
