"""Shared-memory segments of a worker that died: removed by the launcher that started it.

A worker names each segment it makes ``elan-<pid>-<id>`` in ``$ELAN_SHM_DIR`` (default ``/dev/shm``): its send
segment made ahead of an adjustment (the state's size, kept while joiners are queued) and the segment of a transfer
in flight. A worker killed by a signal cannot unlink them; its launcher knows its pid and does. Readers that opened a
segment keep what they opened (an unlink removes only the name).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from lightning_elan.protocol.contract import shm_directory

log = logging.getLogger(__name__)

__all__ = ["remove_segments_of"]


def remove_segments_of(pid: int, env: Mapping[str, str] = os.environ) -> list[Path]:
    """Unlink the segments worker ``pid`` left in its shared-memory directory; returns what was removed."""
    removed = []
    for path in shm_directory(env).glob(f"elan-{pid}-*"):
        try:
            path.unlink()
            removed.append(path)
        except OSError:  # gone meanwhile
            continue
    if removed:
        log.info("removed %d shared-memory segment(s) of the dead worker (pid %d)", len(removed), pid)
    return removed
