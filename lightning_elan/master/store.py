"""Where the AM persists its state: a ``StateStore`` saves and loads one JSON-ready dict.

A store in etcd (:mod:`lightning_elan.master.etcd_store`) may also fail a save: ``StoreUnavailable`` (nothing is known
to be written: the AM does not reply to the request that needed the write, its client resends the same id, and the AM
tries again later) or ``StoreConflict`` (the AM is fenced), both ``StoreError``s.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_elan.etcd import StoreError, StoreUnavailable

__all__ = ["FileStore", "MemoryStore", "StateStore", "StoreConflict", "StoreError", "StoreUnavailable"]


class StoreConflict(StoreError):
    """Another writer changed the state since this store read it, or this AM is no longer the leader: the AM must
    stop writing and stop serving (it has been fenced)."""


@runtime_checkable
class StateStore(Protocol):
    """Persists the AM's state document; ``save`` must be atomic (a reader sees the old or the new state)."""

    def load(self) -> dict[str, Any] | None:
        """The last saved state, or None when nothing was saved yet."""
        ...

    def save(self, state: dict[str, Any]) -> None:
        """Replace the saved state."""
        ...


class FileStore(StateStore):
    """A JSON file replaced atomically: temp file in the same directory, fsync, ``os.replace``, fsync the directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            state = json.loads(text)
        except ValueError as error:
            raise ValueError(f"state file {self.path} is not valid JSON: {error}") from None
        if not isinstance(state, dict):
            raise ValueError(f"state file {self.path} does not hold a JSON object")
        return state

    def save(self, state: dict[str, Any]) -> None:
        payload = json.dumps(state, separators=(",", ":"), allow_nan=False).encode("utf-8")
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as temp_file:
                temp_file.write(payload)
                temp_file.flush()
                os.fsync(temp_file.fileno())
            os.replace(temp_name, self.path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        _fsync_directory(directory)

    def discard_partial_writes(self) -> list[Path]:
        """Delete temp files left by a writer killed before its ``os.replace`` (the state file itself is whole).

        Call it only when no other process writes this store (before an AM starts); returns the deleted files.
        """
        stale = sorted(self.path.parent.glob(f".{self.path.name}.*.tmp"))
        for path in stale:
            path.unlink(missing_ok=True)
        return stale

    def __repr__(self) -> str:
        return f"FileStore({str(self.path)!r})"


class MemoryStore(StateStore):
    """An in-process store (tests, throw-away AMs); keeps a deep copy so later mutations do not leak in."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        return copy.deepcopy(self._state)

    def save(self, state: dict[str, Any]) -> None:
        json.dumps(state, allow_nan=False)  # same contract as FileStore: JSON-serialisable
        self._state = copy.deepcopy(state)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
