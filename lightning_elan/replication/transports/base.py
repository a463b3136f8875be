"""The one interface every way of moving a packed training state implements (after torchft's ``CheckpointTransport``).

A :class:`StateTransport` is bound to one :class:`Channel`: a key prefix of the job's long-lived store where one source
meets its readers. The source calls :meth:`~StateTransport.send` once (for ``readers`` readers), later
:meth:`~StateTransport.disallow` (wait until every reader has its copy, then stop serving) and finally
:meth:`~StateTransport.shutdown` (free everything, delete the channel's keys); each reader calls
:meth:`~StateTransport.receive` on its own instance. Same-host transports (``same_host``) return from ``send`` at once:
the source trains on while its readers copy. A source that cannot serve a transport raises
:class:`TransportUnavailable` from ``send`` and calls :meth:`~StateTransport.publish_fallback`; its readers' ``receive``
then raises :class:`TransportUnavailable` too, so both sides move to the collective together.

This module also owns the store protocol the transports share: the pickled header at ``{prefix}/header`` (CPU state,
layout, where the bytes are) and the acknowledgement counter at ``{prefix}/acks``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_elan.protocol.auth import AuthError, FrameSigner, is_signed, secret_from_env
from lightning_elan.replication.keys import delete_keys, delete_prefix
from lightning_elan.replication.reception import ReceiveInto

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Channel",
    "DeviceFor",
    "Received",
    "StateTransport",
    "TransportUnavailable",
    "wait_count",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_POLL_MIN_S = 1e-4
_POLL_MAX_S = 1e-2

DeviceFor = Callable[[str], torch.device]  # the source's device type -> the local device of a receive buffer


class TransportUnavailable(RuntimeError):
    """This transport cannot be used (no shared-memory space, CUDA IPC refused...): use the collective instead."""


@dataclass(frozen=True)
class Channel:
    """Where one source meets the readers of one transport: the store, a key prefix unique to them, the settings."""

    store: dist.Store
    prefix: str
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable)
    backend: str = "gloo"
    cancelled: Callable[[], bool] | None = None  # True once the transfer's generation failed: waits stop

    @property
    def header_key(self) -> str:
        return f"{self.prefix}/header"

    @property
    def ack_key(self) -> str:
        return f"{self.prefix}/acks"


@dataclass(frozen=True)
class Received:
    """What a reader got: the CPU-side state, the tensors (in the source's order) and the bytes that came in, of them
    ``in_place`` into the reader's own tensors; ``prefaulted``: the rest landed in memory faulted in ahead."""

    cpu_state: Any
    tensors: list[torch.Tensor]
    nbytes: int
    in_place: int = 0
    prefaulted: bool = False


class StateTransport(ABC):
    """Moves one packed snapshot ``(cpu_state, tensors)`` from a source to its readers over one :class:`Channel`."""

    name: ClassVar[str]
    header_format: ClassVar[str]
    same_host: ClassVar[bool] = False  # send() publishes and returns at once; readers copy from shared memory

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._readers = 0  # set by send

    @abstractmethod
    def send(self, cpu_state: Any, tensors: list[torch.Tensor], readers: int) -> int:
        """Publish or send the snapshot for ``readers`` readers; returns the bytes sent (tensor bytes + header).

        Raises :class:`TransportUnavailable` when this transport cannot serve them (nothing is left published).
        """

    @abstractmethod
    def receive(self, reader: int, device_for: DeviceFor, into: ReceiveInto | None = None) -> Received:
        """Reader number ``reader`` (0-based, in plan order) gets its copy, its buffers placed by ``device_for``;
        ``into`` offers the reader's own memory, which a transport may receive into (the shared-memory one does)."""

    def disallow(self, timeout: datetime.timedelta | None = None) -> None:
        """Wait until every reader has its copy, then stop serving (the snapshot may change after this returns)."""
        try:
            self._wait_acks(self._readers, timeout)
        finally:
            self._stop_serving()

    def _stop_serving(self) -> None:  # noqa: B027 - optional hook: a broadcast holds nothing once it returned
        """Free what readers no longer need."""

    def shutdown(self) -> None:
        """Free what this side holds and delete every key of the channel (call after :meth:`disallow`)."""
        store, prefix = self.channel.store, self.channel.prefix
        delete_keys(store, [self.channel.header_key, self.channel.ack_key])
        delete_prefix(store, f"{prefix}/")

    def publish_fallback(self, reason: str) -> None:
        """Tell this channel's readers that the source serves them over the collective instead."""
        self._publish_header({"format": self.header_format, "fallback": reason or "unavailable"})

    # ---------------------------------------------------------------- the store protocol

    def _publish_header(self, header: dict[str, Any]) -> int:
        data = seal(pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL))
        self.channel.store.set(self.channel.header_key, data)
        return len(data)

    def _fetch_header(self) -> tuple[dict[str, Any], int]:
        """The source's header once it is there; :class:`TransportUnavailable` if it published a fallback."""
        store, key = self.channel.store, self.channel.header_key
        wait_key(store, key, self.channel.timeout, f"transfer {self.channel.prefix}: header", self.channel.cancelled)
        data = store.get(key)
        header = pickle.loads(unseal(data, key))
        if not isinstance(header, dict) or header.get("format") != self.header_format:
            got = header.get("format") if isinstance(header, dict) else type(header).__name__
            raise RuntimeError(f"transfer {self.channel.prefix}: expected a {self.header_format} header, got {got!r}")
        if header.get("fallback"):
            reason = header["fallback"]
            raise TransportUnavailable(f"transfer {self.channel.prefix}: the source uses the collective: {reason}")
        return header, len(data)

    def _ack(self) -> None:
        """This reader is done with the source's memory (or, for the collective, has its copy)."""
        self.channel.store.add(self.channel.ack_key, 1)

    def _wait_acks(self, readers: int, timeout: datetime.timedelta | None) -> None:
        what = f"transfer {self.channel.prefix}: readers"
        wait_count(self.channel.store, self.channel.ack_key, readers, timeout or self.channel.timeout, what,
                   self.channel.cancelled)


@functools.cache
def _signer() -> FrameSigner | None:
    """The job's shared secret (``$ELAN_SECRET_FILE``) as a signer, read once per process; None without one."""
    secret = secret_from_env()
    return None if secret is None else FrameSigner(secret)


def seal(data: bytes) -> bytes:
    """A header for the store: signed with the job's secret when there is one (the store itself authenticates
    nobody, and the header is unpickled by the reader)."""
    signer = _signer()
    return data if signer is None else signer.sign(data)


def unseal(data: bytes, key: str) -> bytes:
    """A header's bytes once they authenticate (with a secret): nothing from the store is unpickled before that."""
    signer = _signer()
    if signer is None:
        if is_signed(data):
            raise RuntimeError(f"{key}: the source signed its header but this worker has no secret ($ELAN_SECRET_FILE)")
        return data
    try:
        return signer.verify(data)
    except AuthError as error:
        raise RuntimeError(f"{key}: the header does not authenticate ({error}); it is not read") from None


class TransferCancelled(RuntimeError):
    """The generation a transfer belongs to failed while this side waited for the other."""


def wait_count(store: dist.Store, key: str, count: int, timeout: datetime.timedelta, what: str,
               cancelled: Callable[[], bool] | None = None) -> None:
    """Block until the counter ``key`` (``store.add``) reaches ``count``; ``TimeoutError`` after ``timeout``,
    :class:`TransferCancelled` once ``cancelled()`` is true."""
    _poll(lambda: store.add(key, 0) >= count, timeout, cancelled,
          lambda: f"{what}: {store.add(key, 0)} of {count} acknowledged within {timeout}", what)


def wait_key(store: dist.Store, key: str, timeout: datetime.timedelta, what: str,
             cancelled: Callable[[], bool] | None = None) -> None:
    """Block until ``key`` exists (``store.wait``, or polling when the wait can be cancelled)."""
    if cancelled is None:
        store.wait([key], timeout)
        return
    _poll(lambda: store.check([key]), timeout, cancelled, lambda: f"{what}: not there within {timeout}", what)


def _poll(done: Callable[[], bool], timeout: datetime.timedelta, cancelled: Callable[[], bool] | None,
          timed_out: Callable[[], str], what: str) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    delay = _POLL_MIN_S
    while not done():
        if cancelled is not None and cancelled():
            raise TransferCancelled(f"{what}: the generation failed")
        if time.monotonic() > deadline:
            raise TimeoutError(timed_out())
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
