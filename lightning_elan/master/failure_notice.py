"""The AM announces a lost worker's failure in the job's rendezvous store (``master/heartbeats.py``).

A dead command's launcher (``elan run``, ``elan worker``) sets the generation's failure key
(``contract.failure_key``), which every survivor's failure watch polls (``elastic/failures.py``), so their
collectives stop waiting for a peer that will never answer. A lost host has nobody left to set it: the AM does, in
the store it serves (a ``TCPStore`` beside the file store) or in etcd, under the keys of the job's
``EtcdRendezvousStore``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_elan.etcd import EtcdConnection, EtcdLocator
from lightning_elan.protocol.contract import failure_key

__all__ = ["FailureNotice", "etcd_notice", "lost_value", "tcp_store_notice"]

FailureNotice = Callable[[str, list[int]], None]
"""``(worker_id, generations)``: set the failure keys of ``generations`` for the lost ``worker_id``."""

ETCD_RETRY_S = 5.0
"""How long an etcd outage may delay the announcement (the AM's loop waits meanwhile)."""


def lost_value(worker_id: str) -> bytes:
    """The failure key's value for a lost worker (a dead one's launcher writes its id; a stalled member
    ``stalled:ID``)."""
    return f"lost:{worker_id}".encode()


def tcp_store_notice(store: Any) -> FailureNotice:
    """Announce in the ``torch.distributed.TCPStore`` this AM process serves."""

    def announce(worker_id: str, generations: list[int]) -> None:
        for generation in generations:
            store.set(failure_key(generation), lost_value(worker_id))

    return announce


def etcd_notice(locator: EtcdLocator, job: str) -> FailureNotice:
    """Announce in ``job``'s rendezvous store in etcd."""

    def announce(worker_id: str, generations: list[int]) -> None:
        connection = EtcdConnection(locator.endpoints, retry_s=ETCD_RETRY_S)
        for generation in generations:
            connection.put(locator.rendezvous_root(job) + failure_key(generation), lost_value(worker_id))

    return announce
