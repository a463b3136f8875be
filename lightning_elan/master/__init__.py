"""The application master: job state machine, state stores, registry and ZeroMQ server.

``ApplicationMaster`` is imported lazily so that the pure state machine can be used without ZeroMQ.
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.store import FileStore, MemoryStore, StateStore

__all__ = ["ApplicationMaster", "FileStore", "JobState", "MemoryStore", "StateError", "StateStore"]


__getattr__, __dir__ = lazy_exports(__name__, {"ApplicationMaster": "server"})
