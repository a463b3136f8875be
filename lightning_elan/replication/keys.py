"""Deleting keys from the job's long-lived store: owns the one way an adjustment's keys are cleaned up.

Every adjustment writes under its own prefix (the engine uses ``elan/gen{g}/``): transfer headers, acknowledgements,
wave counters, transfer groups' rendezvous keys. :func:`delete_prefix` removes them once the adjustment is complete,
so they do not accumulate for the life of the job; :func:`delete_keys` removes keys known by name.

Listing needs ``Store.list_keys()``: torch's ``TCPStore`` (server and clients) and ``HashStore`` have it (torch >= 2.7;
2.13 here). A ``PrefixStore`` lists only the keys under its own prefix, with that prefix stripped, and matches without
the ``/`` separator (its ``"elan"`` view also returns ``"ther"`` for a key ``"elanother"``): keys are filtered again
here, so only keys starting with the requested prefix are deleted. A store without ``list_keys`` (older torch, custom
stores) keeps the keys :func:`delete_prefix` cannot list: it logs that once and returns 0; the transports also delete
the keys they know by name, which works on any store.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["delete_keys", "delete_prefix"]

_warned_unlisted: set[str] = set()


def delete_prefix(store: dist.Store, prefix: str) -> int:
    """Delete every key of ``store`` that starts with ``prefix``; returns how many were deleted.

    Give a prefix that ends with a separator (``"elan/gen3/"``): ``"elan/gen3"`` would also match ``"elan/gen30/..."``.
    """
    keys = _list_keys(store)
    if keys is None:
        return 0
    return delete_keys(store, (key for key in keys if key.startswith(prefix)))


def delete_keys(store: dist.Store, keys: Iterable[str]) -> int:
    """Delete ``keys`` (absent ones are skipped); returns how many existed."""
    return sum(1 for key in keys if store.delete_key(key))


def _list_keys(store: dist.Store) -> list[str] | None:
    try:
        return list(store.list_keys())
    except (AttributeError, NotImplementedError, RuntimeError) as error:
        kind = type(store).__name__
        if kind not in _warned_unlisted:
            _warned_unlisted.add(kind)
            log.warning("%s cannot list its keys (%s): per-adjustment keys stay in it", kind, error)
        return None
