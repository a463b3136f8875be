"""An AM with a shared secret (real ZeroMQ sockets, in process): every frame is authenticated before it is parsed;
unsigned, wrongly signed, replayed and stale frames are refused and change nothing; clients with the secret work."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import FileStore
from lightning_elan.protocol import AMClient, AMError
from lightning_elan.protocol.auth import AuthError, FrameSigner
from lightning_elan.protocol.messages import encode_request

JOB = "job"
SECRET = b"the-jobs-shared-secret-0123456789"


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False,
                               secret=SECRET).start()
    with AMClient(master.address, JOB, timeout_s=1.0, retries=1, secret=SECRET) as client:
        client.request("start_job", {"nproc": 2, "coordinate_every": 5})
    yield master
    master.stop()


@pytest.fixture
def dealer(am: ApplicationMaster) -> Iterator[zmq.Socket]:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(am.address)
    yield socket
    socket.close(linger=0)


def ask(socket: zmq.Socket, frame: bytes) -> dict:
    socket.send(frame)
    assert socket.poll(2000), "no reply"
    reply = socket.recv()
    return json.loads(FrameSigner(SECRET).verify(reply))  # replies are signed too


def pending(am: ApplicationMaster) -> int:
    with AMClient(am.address, JOB, timeout_s=1.0, retries=1, secret=SECRET) as client:
        return len(client.status()["pending"])


def test_a_client_with_the_secret_steers_the_job(am):
    with AMClient(am.address, JOB, timeout_s=1.0, retries=1, secret=SECRET) as client:
        assert client.scale("add", count=1)["request_id"] == "r1"
    assert pending(am) == 1


def test_unsigned_and_wrongly_signed_frames_are_refused_and_change_nothing(am, dealer):
    scale = encode_request("m1", JOB, "scale", {"action": "add", "count": 1})
    refusal = ask(dealer, scale)
    assert not refusal["ok"] and "authentication failed: unsigned frame" in refusal["error"]
    forged = FrameSigner(b"not-the-jobs-secret-but-long").sign(scale)
    assert "bad signature" in ask(dealer, forged)["error"]
    assert pending(am) == 0


def test_a_replayed_frame_is_refused_and_applied_once(am, dealer):
    frame = FrameSigner(SECRET).sign(encode_request("m2", JOB, "scale", {"action": "add", "count": 1}))
    assert ask(dealer, frame)["ok"]
    replay = ask(dealer, frame)
    assert not replay["ok"] and "replayed" in replay["error"]
    assert pending(am) == 1


def test_a_stale_frame_is_refused(am, dealer):
    old = FrameSigner(SECRET, clock=lambda: 0.0).sign(encode_request("m3", JOB, "scale", {"action": "add"}))
    assert "stale" in ask(dealer, old)["error"]
    assert pending(am) == 0


def test_clients_without_or_with_another_secret_get_a_clear_error(am):
    with AMClient(am.address, JOB, timeout_s=1.0, retries=0, secret=None) as client, \
            pytest.raises(AMError, match="requires a shared secret"):
        client.status()
    with AMClient(am.address, JOB, timeout_s=1.0, retries=0, secret=b"another-secret-0123456789") as client, \
            pytest.raises(AMError, match="does not verify"):
        client.status()


def test_an_am_without_a_secret_refuses_signed_frames_and_open_binds(tmp_path):
    with pytest.raises(AuthError, match="without a secret"):
        ApplicationMaster(JOB, FileStore(tmp_path / "s.json"), bind="tcp://0.0.0.0:0", register=False)
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), register=False).start()
    try:
        with AMClient(master.address, JOB, timeout_s=1.0, retries=0, secret=SECRET) as client, \
                pytest.raises(AMError, match="has no secret"):
            client.status()
    finally:
        master.stop()
