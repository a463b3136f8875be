"""``adjustments.jsonl``: one JSON line per completed adjustment, appended after the state that completes it.

An AM killed between persisting a completed adjustment and appending its line (or in the middle of the line) leaves
the journal one record behind the state; :func:`repair` brings it level when the next AM starts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def append(path: Path, record: dict[str, Any]) -> None:
    """Append one record as a line, fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record, separators=(",", ":")) + "\n")
        file.flush()
        os.fsync(file.fileno())


def repair(path: Path, last_record: dict[str, Any] | None) -> bool:
    """Drop a torn last line, then append ``last_record`` (the state's last completed adjustment) if the journal has
    no record of its generation; returns whether the journal changed."""
    changed = _drop_torn_tail(path)
    if last_record is None or _generation_of(last_record) in _generations(path):
        return changed
    log.warning("%s lacks the record of the adjustment to generation %s (the AM stopped before writing it): "
                "appending it", path, last_record["generation"])
    append(path, last_record)
    return True


def _drop_torn_tail(path: Path) -> bool:
    """Truncate a last line that has no newline (a write cut short)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    log.warning("%s ends with a torn line (%d bytes): dropping it", path, len(data) - keep)
    with open(path, "r+b") as file:
        file.truncate(keep)
        file.flush()
        os.fsync(file.fileno())
    return True


def _generations(path: Path) -> set[int]:
    """The generations the journal holds a record for."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return set()
    return {_generation_of(json.loads(line)) for line in lines if line.strip()}


def _generation_of(record: dict[str, Any]) -> int:
    return int(record.get("generation", -1))
