"""Shared-memory transport between real processes on this host (CPU), bit-exact."""

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

from lightning_elan.replication.packing import empty_buffers, unpack
from lightning_elan.replication.planner import plan_transfers
from lightning_elan.replication.shm import (
    ShmUnavailable,
    receive_state_shm,
    send_state_shm,
    share_state_shm,
)
from lightning_elan.replication.topology import WorkerTopology, detect

TIMEOUT = datetime.timedelta(seconds=60)
CTX = mp.get_context("spawn")


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


def _receive(port: int, prefix: str, out: str) -> None:
    cpu_state, tensors, received = receive_state_shm(client(port), prefix, lambda _: torch.device("cpu"))
    Path(out).write_bytes(pickle.dumps((cpu_state, [t.clone() for t in tensors], received)))


def run(procs: list[mp.Process], started: bool = False) -> None:
    for p in procs:
        if not started:
            p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), codes


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def segments(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.glob("elan-*"))


# ------------------------------------------------------------------ tests


def test_one_source_two_destinations_bit_equal(store: dist.TCPStore, tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    receivers = [CTX.Process(target=_receive, args=(store.port, "t1", str(tmp_path / f"r{i}"))) for i in range(2)]
    for p in receivers:
        p.start()  # they wait for the header

    sent = send_state_shm(store, "t1", *make_state(7), receivers=2, shm_dir=shm_dir, timeout=TIMEOUT)
    run(receivers, started=True)

    want_state, want = make_state(7)
    for i in range(2):
        cpu_state, tensors, received = pickle.loads((tmp_path / f"r{i}").read_bytes())
        assert_bit_equal(tensors, want)
        assert cpu_state["step"] == 123 and cpu_state["name"] == "ü"
        assert torch.equal(cpu_state["rng"], want_state["rng"])
        assert received == sent
    assert segments(shm_dir) == []  # the source unlinked its segment


def test_grow_two_to_four_each_joiner_copies_from_its_own_stayer(store: dist.TCPStore, tmp_path: Path) -> None:
    # the planner, fed this host's real topology, pairs each joiner with a distinct stayer over shared memory
    here = detect("cpu")
    plan = plan_transfers({"w0": here, "w1": here}, {"w2": here, "w3": here})
    assert {t.source for t in plan} == {"w0", "w1"}
    assert {t.transport for t in plan} == {"shm"} and {t.wave for t in plan} == {0}

    joiners = []
    for source in ("w0", "w1"):  # the two stayers publish at once (share_* returns without waiting)
        for t in (t for t in plan if t.source == source):
            joiners.append(CTX.Process(target=_receive, args=(store.port, f"g1/{source}", str(tmp_path / t.joiner))))
    shares = [share_state_shm(store, f"g1/{s}", *make_state(5), receivers=1) for s in ("w0", "w1")]

    run(joiners)
    for share in shares:
        share.wait(TIMEOUT)
        share.close()

    want = make_state(5)[1]
    for joiner in ("w2", "w3"):
        assert_bit_equal(pickle.loads((tmp_path / joiner).read_bytes())[1], want)


def test_in_process_round_trip_and_unlink_after_wait(store: dist.TCPStore, tmp_path: Path) -> None:
    cpu_state, tensors = make_state(3)
    share = share_state_shm(store, "p", cpu_state, tensors, shm_dir=tmp_path)
    assert segments(tmp_path) == [share.path.name]

    got_state, got, received = receive_state_shm(store, "p", lambda _: torch.device("cpu"))
    share.wait(TIMEOUT)
    share.close()

    assert_bit_equal(got, tensors)
    assert received == share.nbytes and got_state["position"] == [4, 5]
    assert segments(tmp_path) == []


def test_sender_times_out_and_cleans_up_without_receivers(store: dist.TCPStore, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="0 of 1 acknowledged"):
        send_state_shm(store, "q", {}, [torch.ones(3)], shm_dir=tmp_path, timeout=datetime.timedelta(seconds=0.2))
    assert segments(tmp_path) == []


def test_no_shared_memory_directory_is_reported(store: dist.TCPStore, tmp_path: Path) -> None:
    with pytest.raises(ShmUnavailable):
        send_state_shm(store, "x", {}, [torch.ones(3)], shm_dir=tmp_path / "missing")


def test_empty_state(store: dist.TCPStore, tmp_path: Path) -> None:
    share = share_state_shm(store, "e", {"only": "cpu"}, [], shm_dir=tmp_path)
    cpu_state, tensors, _ = receive_state_shm(store, "e", lambda _: torch.device("cpu"))
    share.wait(TIMEOUT)
    share.close()
    assert (cpu_state, tensors) == ({"only": "cpu"}, [])


def test_cpu_workers_of_this_host_are_l2_to_each_other() -> None:
    a, b = detect("cpu"), detect(None)
    assert isinstance(a, WorkerTopology) and a.host == os.uname().nodename
    assert plan_transfers({"a": a}, {"b": b})[0].level == 2


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
    """The CUDA IPC transport's header/ack protocol and range copies, run on CPU with the device calls replaced."""
    from lightning_elan.replication import shm
    from lightning_elan.replication.cuda import ipc

    monkeypatch.setattr(ipc, "alloc_shareable", lambda n, d: torch.full((n,), 0xA5, dtype=torch.uint8))
    monkeypatch.setattr(ipc, "ipc_export", lambda a: ipc.IpcHandle("fake", a, a.numel(), 0))
    monkeypatch.setattr(ipc, "ipc_open", FakeMapping)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cpu_state, tensors = make_state(9)

    share = shm.share_state_ipc(store, "ipc", cpu_state, tensors, "cuda:0", receivers=2)
    got_state, got, received = shm.receive_state_ipc(store, "ipc", "cuda:0", lambda _: torch.device("cpu"))
    with shm.IpcReader(store, "ipc", "cuda:0", TIMEOUT) as reader:  # a second destination
        buffers = empty_buffers(reader.layout, lambda _: torch.device("cpu"))
        copied = reader.copy_to(buffers)
    share.wait(TIMEOUT)
    share.close()

    assert_bit_equal(got, tensors)
    assert_bit_equal(unpack(buffers, reader.layout), tensors)
    assert copied == sum(t.numel() * t.element_size() for t in tensors)
    assert received == share.nbytes and got_state["step"] == 123
    assert all(m.closed for m in FakeMapping.opened) and store.add("ipc/acks", 0) == 2


def test_zero_copy_tensors_are_private_copies_on_write(store: dist.TCPStore, tmp_path: Path) -> None:
    cpu_state, tensors = make_state(4)
    share = share_state_shm(store, "z", cpu_state, tensors, receivers=3, shm_dir=tmp_path)
    cpu = lambda _: torch.device("cpu")  # noqa: E731

    _, first, _ = receive_state_shm(store, "z", cpu)
    _, second, _ = receive_state_shm(store, "z", cpu)
    _, copied, _ = receive_state_shm(store, "z", cpu, zero_copy=False)
    share.wait(TIMEOUT)
    share.close()
    first[0].add_(1.0)  # a joiner trains on its tensors: only its own pages change

    assert_bit_equal(second, tensors)
    assert_bit_equal(copied, tensors)
    assert torch.equal(first[0], tensors[0] + 1.0)
    assert segments(tmp_path) == []


def test_a_fallback_reaches_the_destinations(store: dist.TCPStore, tmp_path: Path) -> None:
    from lightning_elan.replication.shm import publish_fallback

    with pytest.raises(ShmUnavailable) as raised:
        share_state_shm(store, "f", {}, [torch.ones(3)], shm_dir=tmp_path / "missing")
    publish_fallback(store, "f", "shm", str(raised.value))

    with pytest.raises(ShmUnavailable, match="fell back to the collective"):
        receive_state_shm(store, "f", lambda _: torch.device("cpu"))


def test_waves_release_the_next_wave_once_the_previous_was_received(store: dist.TCPStore) -> None:
    from lightning_elan.replication.shm import mark_wave_received, wait_for_wave

    short = datetime.timedelta(seconds=0.1)
    wait_for_wave(store, "g1", 0, 5, short)  # wave 0 never waits
    mark_wave_received(store, "g1", 0)
    with pytest.raises(TimeoutError, match="wave 0: 1 of 2"):
        wait_for_wave(store, "g1", 1, 2, short)
    mark_wave_received(store, "g1", 0)
    wait_for_wave(store, "g1", 1, 2, short)


def test_segments_left_by_a_crashed_source_are_removed_later(store: dist.TCPStore, tmp_path: Path) -> None:
    from lightning_elan.replication.shm import remove_stale_segments

    stale, fresh = tmp_path / "elan-1-old", tmp_path / "elan-2-new"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (1, 1))

    assert remove_stale_segments(tmp_path) == [stale]
    assert segments(tmp_path) == ["elan-2-new"]
