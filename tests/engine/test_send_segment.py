"""A source's shared-memory segment made ahead (``replication/send_segment.py``): allocated in a thread, taken by a
send, kept for the next one, removed when released; and the shared-memory transport writing into it, read by real
reader processes, bit-exact, twice into the same file."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch.distributed as dist

from lightning_elan.elastic.send_ahead import SendAhead
from lightning_elan.replication.send_segment import SendSegment
from lightning_elan.replication.transports import ShmTransport, transport_for
from lightning_elan.replication.transports.base import Channel
from tests.engine.test_shm_transport import CTX, TIMEOUT, _receive, assert_bit_equal, make_state, run, segments


def test_prepared_segment_is_allocated_taken_kept_and_removed(tmp_path: Path) -> None:
    segment = SendSegment(tmp_path, duty=1.0)
    segment.prepare(3 << 20)
    prepared = segment.take(3 << 20)
    assert prepared is not None and prepared.nbytes >= 3 << 20
    assert os.fstat(prepared.fd).st_blocks * 512 >= 3 << 20  # allocated, not a hole
    assert segment.take(3 << 20) is None  # one send at a time
    segment.give_back(prepared)
    segment.prepare(1 << 20)  # big enough: kept as it is
    again = segment.take(2 << 20)
    assert again is prepared and segments(tmp_path) == [prepared.path.name]
    segment.give_back(again)
    segment.release()
    assert segments(tmp_path) == [] and segment.nbytes_held == 0


def test_a_segment_released_while_in_use_goes_when_given_back(tmp_path: Path) -> None:
    segment = SendSegment(tmp_path)
    segment.prepare(1 << 20)
    prepared = segment.take(1 << 20)
    assert prepared is not None
    segment.release()
    assert segments(tmp_path) == [prepared.path.name]  # a send is writing it
    segment.give_back(prepared)
    assert segments(tmp_path) == []


def test_a_short_segment_grows_and_a_swept_one_is_not_used(tmp_path: Path) -> None:
    segment = SendSegment(tmp_path)
    segment.prepare(1 << 20)
    prepared = segment.take(5 << 20)
    assert prepared is not None and os.fstat(prepared.fd).st_size == 5 << 20
    segment.give_back(prepared)
    prepared.path.unlink()  # a stale-segment sweep removed it
    assert segment.take(1 << 20) is None
    segment.prepare(1 << 20)
    fresh = segment.take(1 << 20)
    assert fresh is not None and fresh.path != prepared.path
    segment.discard(fresh)
    assert segments(tmp_path) == []


def test_two_sends_write_the_same_segment_and_every_reader_gets_its_own_state(store: dist.TCPStore,
                                                                             tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    segment = SendSegment(shm_dir)
    paths = []
    for adjustment, seed in enumerate((11, 12)):
        cpu_state, tensors = make_state(seed)
        segment.prepare(sum(t.numel() * t.element_size() for t in tensors) + (1 << 20))
        prefix = f"adj{adjustment}"
        reader = CTX.Process(target=_receive, args=(store.port, prefix, 0, str(tmp_path / prefix)))
        source = transport_for("shm", Channel(store, prefix, TIMEOUT), segment)
        assert isinstance(source, ShmTransport)
        source.send(cpu_state, tensors, readers=1)
        paths.append(source.path)
        run([reader])
        source.disallow()
        source.shutdown()
        assert segments(shm_dir) == [paths[0].name]  # kept for the next adjustment, not unlinked
        got_state, got, _ = pickle.loads((tmp_path / prefix).read_bytes())
        assert_bit_equal(got, tensors)
        assert got_state["step"] == cpu_state["step"]
    assert paths[0] == paths[1]
    segment.release()
    assert segments(shm_dir) == []


def test_send_ahead_prepares_while_joiners_come_and_lets_go_after(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELAN_SHM_DIR", str(tmp_path))
    ahead = SendAhead("joiners")
    ahead.at_coordination(False, lambda: 1 << 20)
    assert ahead.segment is None
    ahead.at_coordination(True, lambda: 1 << 20)
    assert ahead.segment is not None and ahead.segment.take(1 << 20) is not None
    ahead.at_coordination(False, lambda: 1 << 20)  # released: gone when the send gives it back
    assert len(segments(tmp_path)) == 1
    ahead.close()


def test_send_ahead_off_makes_nothing_and_always_keeps_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELAN_SHM_DIR", str(tmp_path))
    off, always = SendAhead("off"), SendAhead("always")
    for joiners_coming in (True, False):
        off.at_coordination(joiners_coming, lambda: 1 << 20)
        always.at_coordination(joiners_coming, lambda: 1 << 20)
    assert off.segment is None and always.segment is not None
    always.segment.wait()
    assert always.segment.nbytes_held >= 1 << 20
    assert len(segments(tmp_path)) == 1
    always.close()
    assert segments(tmp_path) == []


def test_a_segment_that_cannot_be_made_is_not_tried_again(tmp_path: Path, caplog) -> None:
    segment = SendSegment(tmp_path / "no-such-dir")
    for _ in range(3):
        segment.prepare(1 << 20)
        assert segment.take(1 << 20) is None
    assert len([r for r in caplog.records if "cannot prepare" in r.message]) == 1
