"""The application master: job state machine, state stores, registry and ZeroMQ server.

``ApplicationMaster`` is imported lazily so that the pure state machine can be used without ZeroMQ.
"""

from __future__ import annotations

from typing import Any

from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.store import FileStore, MemoryStore, StateStore

__all__ = ["ApplicationMaster", "FileStore", "JobState", "MemoryStore", "StateError", "StateStore"]


def __getattr__(name: str) -> Any:
    if name == "ApplicationMaster":
        from lightning_elan.master.server import ApplicationMaster

        return ApplicationMaster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
