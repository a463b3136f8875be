"""The job registry: ``$ELAN_HOME/jobs/NAME.json`` tells ``elan scale/status`` where a job's AM listens."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lightning_elan.master.store import FileStore
from lightning_elan.protocol.contract import ENV_HOME

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def elan_home() -> Path:
    """``$ELAN_HOME``, default ``~/.elan``."""
    return Path(os.environ.get(ENV_HOME) or "~/.elan").expanduser()


def check_job_name(job: str) -> str:
    """Return ``job`` if it is usable as a file name, else raise ``ValueError``."""
    if not _JOB_NAME.match(job) or len(job) > 200:
        raise ValueError(f"invalid job name {job!r}: use letters, digits, '_', '.', '-' (not starting with '.')")
    return job


def job_file(job: str) -> Path:
    """``$ELAN_HOME/jobs/NAME.json``."""
    return elan_home() / "jobs" / f"{check_job_name(job)}.json"


def default_state_dir(job: str) -> Path:
    """``$ELAN_HOME/jobs/NAME/``: the default home of ``state.json`` and ``adjustments.jsonl``."""
    return elan_home() / "jobs" / check_job_name(job)


def write(job: str, address: str, state_dir: str | Path | None = None, pid: int | None = None) -> Path:
    """Register a running AM (atomic replace); returns the registry file."""
    entry = {
        "job": job,
        "address": address,
        "pid": os.getpid() if pid is None else pid,
        "state_dir": None if state_dir is None else str(state_dir),
    }
    path = job_file(job)
    FileStore(path).save(entry)
    return path


def read(job: str) -> dict[str, Any] | None:
    """The registry entry ``{job, address, pid, state_dir}`` of a job, or None when no AM is registered."""
    return FileStore(job_file(job)).load()


def remove(job: str, address: str | None = None) -> bool:
    """Remove a job's entry (only if it still names ``address``, when given); returns whether a file was removed."""
    path = job_file(job)
    if address is not None:
        entry = read(job)
        if entry is None or entry.get("address") != address:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
