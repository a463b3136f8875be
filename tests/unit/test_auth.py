"""Frame authentication (pure): HMAC-SHA256 with nonce and timestamp; forged, altered, stale, replayed and malformed
frames are refused with their reason."""

from __future__ import annotations

import os

import pytest

from lightning_elan.protocol.auth import (
    MAGIC,
    AuthError,
    FrameSigner,
    load_secret,
    refuse_open_bind,
    secret_from_env,
)

SECRET = b"0123456789abcdef-shared-secret"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_signed_frame_verifies_once_and_carries_its_payload():
    clock = Clock()
    sender, receiver = FrameSigner(SECRET, clock=clock), FrameSigner(SECRET, clock=clock)
    frame = sender.sign(b'{"v": 1}')
    assert frame.startswith(MAGIC)
    assert receiver.verify(frame) == b'{"v": 1}'
    with pytest.raises(AuthError, match="replayed"):
        receiver.verify(frame)
    assert receiver.verify(sender.sign(b'{"v": 1}')) == b'{"v": 1}', "the same payload with a fresh nonce passes"


@pytest.mark.parametrize(("tamper", "reason"), [
    (lambda f: f[:-1] + b"X", "bad signature"),  # payload altered
    (lambda f: f.replace(b"\n", b"\n9", 2), "bad signature|malformed"),  # timestamp altered
    (lambda f: f[len(MAGIC):], "unsigned"),  # signature stripped
    (lambda f: MAGIC + b"garbage", "malformed"),
    (lambda f: MAGIC + b"\n\n\n", "malformed"),
])
def test_altered_or_malformed_frames_are_refused(tamper, reason):
    clock = Clock()
    frame = FrameSigner(SECRET, clock=clock).sign(b'{"type": "scale"}')
    with pytest.raises(AuthError, match=reason):
        FrameSigner(SECRET, clock=clock).verify(tamper(frame))


def test_a_frame_signed_with_another_secret_is_refused():
    clock = Clock()
    frame = FrameSigner(b"another-secret-of-16-bytes", clock=clock).sign(b"{}")
    with pytest.raises(AuthError, match="bad signature"):
        FrameSigner(SECRET, clock=clock).verify(frame)


def test_frames_outside_the_window_are_stale_and_nonces_are_forgotten_after_it():
    clock = Clock()
    sender, receiver = FrameSigner(SECRET, clock=clock), FrameSigner(SECRET, window_s=60, clock=clock)
    old = sender.sign(b"{}")
    clock.now += 61
    with pytest.raises(AuthError, match="stale"):
        receiver.verify(old)
    future = FrameSigner(SECRET, clock=Clock(clock.now + 120)).sign(b"{}")
    with pytest.raises(AuthError, match="stale"):
        receiver.verify(future)
    for _ in range(5):
        receiver.verify(sender.sign(b"{}"))
    clock.now += 500  # every remembered nonce expired: the memory is bounded by the window
    receiver.verify(sender.sign(b"{}"))
    assert len(receiver._seen) == 1


def test_secrets_come_from_a_file_and_must_be_long_enough(tmp_path):
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_bytes(SECRET + b"\n")
    short.write_bytes(b"tiny")
    os.chmod(good, 0o600)
    assert load_secret(good) == SECRET
    assert secret_from_env({"ELAN_SECRET_FILE": str(good)}) == SECRET and secret_from_env({}) is None
    with pytest.raises(AuthError, match="at least 16"):
        load_secret(short)
    with pytest.raises(AuthError, match="cannot read"):
        load_secret(tmp_path / "missing")


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://[::]:5555"])
def test_binding_beyond_loopback_without_a_secret_is_refused(bind):
    with pytest.raises(AuthError, match="without a secret"):
        refuse_open_bind(bind, None)
    refuse_open_bind(bind, SECRET)


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", "tcp://localhost:5555", "tcp://[::1]:5555"])
def test_loopback_needs_no_secret(bind):
    refuse_open_bind(bind, None)


def test_replication_headers_are_signed_with_the_jobs_secret_and_checked_before_unpickling(tmp_path, monkeypatch):
    from lightning_elan.replication.transports import base

    key = tmp_path / "key"
    key.write_bytes(SECRET)
    monkeypatch.setenv("ELAN_SECRET_FILE", str(key))
    base._signer.cache_clear()
    try:
        sealed = base.seal(b"pickled header")
        assert sealed.startswith(MAGIC) and base.unseal(sealed, "k") == b"pickled header"
        with pytest.raises(RuntimeError, match="does not authenticate"):
            base.unseal(sealed[:-1] + b"!", "k")
        with pytest.raises(RuntimeError, match="does not authenticate"):
            base.unseal(b"an unsigned pickle", "k")
        monkeypatch.delenv("ELAN_SECRET_FILE")
        base._signer.cache_clear()
        with pytest.raises(RuntimeError, match="has no secret"):
            base.unseal(sealed, "k")
        assert base.seal(b"plain") == b"plain"
    finally:
        base._signer.cache_clear()
