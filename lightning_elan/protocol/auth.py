"""Authenticated AM frames: HMAC-SHA256 with a nonce and a timestamp over every request and reply (pure).

A signed frame is ``MAGIC nonce "\\n" timestamp_ms "\\n" mac "\\n" payload``: ``mac`` is the hex HMAC-SHA256, under
the job's shared secret, of everything after ``MAGIC`` up to the mac (nonce and timestamp) and of the payload (the
JSON request or reply). A frame is accepted when its mac verifies (constant-time comparison), its timestamp is
within ``window_s`` of the receiver's clock, and its nonce was not seen within the window — so a captured frame can
be neither altered nor replayed. The payload is parsed only after that.

The secret is read from a file (``--secret-file``, ``$ELAN_SECRET_FILE``); Horovod's HMAC has no nonce (replays
pass) and torch's TCPStore has no authentication at all, which is why both directions are signed here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from lightning_elan.protocol.contract import ENV_SECRET_FILE

log = logging.getLogger(__name__)

__all__ = [
    "MAGIC",
    "AuthError",
    "FrameSigner",
    "is_signed",
    "load_secret",
    "refuse_open_bind",
    "secret_from_env",
]

MAGIC = b"ELAN-HMAC-SHA256\n"
DEFAULT_WINDOW_S = 60.0
MAX_REMEMBERED_NONCES = 200_000  # at ~3,300 frames/s for a minute: beyond that the oldest are forgotten early
_NONCE_BYTES = 16
MIN_SECRET_BYTES = 16


class AuthError(ValueError):
    """A frame that does not authenticate (the reason is safe to send back: it reveals nothing of the secret)."""


def is_signed(frame: bytes) -> bool:
    return frame.startswith(MAGIC)


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in ``path`` (surrounding whitespace removed; at least 16 bytes)."""
    file = Path(path).expanduser()
    try:
        secret = file.read_bytes().strip()
    except OSError as error:
        raise AuthError(f"cannot read the secret file {file}: {error.strerror or error}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"the secret in {file} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                        f"(e.g. `head -c 32 /dev/urandom | base64 > {file}`)")
    if file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the secret file %s is readable by other users (chmod 600 it)", file)
    return secret


def secret_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The secret named by ``$ELAN_SECRET_FILE``, or None when it is not set."""
    path = (os.environ if environ is None else environ).get(ENV_SECRET_FILE)
    return load_secret(path) if path else None


def refuse_open_bind(bind: str, secret: bytes | None) -> None:
    """An AM bound beyond loopback must authenticate its clients: refuse to start without a secret."""
    if secret is not None:
        return
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise AuthError(f"refusing to bind the AM to {bind} without a secret: anyone who reaches it could steer the "
                        "job. Pass --secret-file (or set $ELAN_SECRET_FILE), or bind 127.0.0.1")


class FrameSigner:
    """Signs outgoing frames and verifies incoming ones for one shared secret (one instance per receiver: it
    remembers the nonces it accepted)."""

    def __init__(self, secret: bytes, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise AuthError(f"a secret needs at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> the time it can be forgotten

    def sign(self, payload: bytes) -> bytes:
        nonce = secrets.token_hex(_NONCE_BYTES).encode()
        stamp = str(round(self._clock() * 1000)).encode()
        header = nonce + b"\n" + stamp + b"\n"
        return MAGIC + header + self._mac(header, payload) + b"\n" + payload

    def verify(self, frame: bytes) -> bytes:
        """The payload of an authentic, fresh, first-seen frame; raises :class:`AuthError` with the reason."""
        if not is_signed(frame):
            raise AuthError("unsigned frame: this AM requires a shared secret (--secret-file or $ELAN_SECRET_FILE)")
        nonce, stamp, mac, payload = self._split(frame[len(MAGIC):])
        if not hmac.compare_digest(mac, self._mac(nonce + b"\n" + stamp + b"\n", payload)):
            raise AuthError("bad signature (a different secret, or an altered frame)")
        age = self._clock() - int(stamp) / 1000
        if abs(age) > self.window_s:
            raise AuthError(f"stale frame: signed {age:.0f} s from now, outside the {self.window_s:g} s window")
        self._remember(nonce)
        return payload

    def _mac(self, header: bytes, payload: bytes) -> bytes:
        return hmac.new(self._secret, header + payload, hashlib.sha256).hexdigest().encode()

    @staticmethod
    def _split(rest: bytes) -> tuple[bytes, bytes, bytes, bytes]:
        parts = rest.split(b"\n", 3)
        if len(parts) != 4 or len(parts[0]) != 2 * _NONCE_BYTES or not parts[1].isdigit() or len(parts[2]) != 64:
            raise AuthError("malformed signed frame")
        return parts[0], parts[1], parts[2], parts[3]

    def _remember(self, nonce: bytes) -> None:
        now = self._clock()
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= MAX_REMEMBERED_NONCES):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AuthError("replayed frame (its nonce was seen already)")
        self._seen[nonce] = now + 2 * self.window_s
