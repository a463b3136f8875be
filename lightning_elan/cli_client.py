"""How an ``elan`` command reaches a running job's AM: the shared secret, the job registry, the client and its errors.

Every failure here is a :class:`CLIError`: ``elan: error: <message>`` with its exit code (2 for an unknown job or an
AM that does not answer, 1 for an error the AM replied).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_elan.master import registry
from lightning_elan.protocol.contract import ENV_SECRET_FILE

__all__ = ["DEFAULT_TIMEOUT_S", "CLIError", "call", "connect", "dead_local_pid", "read_registry", "refuse_if_running",
           "use_secret_file"]

DEFAULT_TIMEOUT_S = 2.0


class CLIError(Exception):
    """A failure reported as ``elan: error: <message>`` with ``code`` as the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def use_secret_file(path: Path | None) -> None:
    """``--secret-file``: checked now, then found through ``$ELAN_SECRET_FILE`` by every client, the AM and the
    workers this command starts (the secret itself never travels on a command line)."""
    from lightning_elan.protocol.auth import AuthError, load_secret

    if path is not None:
        os.environ[ENV_SECRET_FILE] = str(path.expanduser().resolve())
    if os.environ.get(ENV_SECRET_FILE):
        try:
            load_secret(os.environ[ENV_SECRET_FILE])
        except AuthError as error:
            raise CLIError(str(error), code=2) from None


def read_registry(job: str) -> dict[str, Any]:
    """The job's registry entry ``{job, address, pid, state_dir}``; CLIError (exit 2) if there is none."""
    path = registry.job_file(job)
    try:
        entry = registry.read(job)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read the registry file of job {job} ({path}): {exc}", code=2) from None
    if entry is None:
        raise CLIError(f"no running job named {job} (looked in {path})", code=2)
    if not entry.get("address"):
        raise CLIError(f"registry file {path} of job {job} has no AM address", code=2)
    return entry


def connect(job: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, retries: int | None = None,
            am: str | None = None) -> Any:
    """An ``AMClient`` for the running job ``job``: at ``am`` if given, else at the address in the registry."""
    from lightning_elan.protocol.client import AMClient

    if am is not None:
        return AMClient(am, job, timeout_s=timeout_s, **({} if retries is None else {"retries": retries}))
    entry = read_registry(job)

    address = str(entry["address"])
    gone = dead_local_pid(address, entry.get("pid"))
    if gone is not None:
        raise CLIError(
            f"job {job}'s AM at {address} does not answer (its process {gone} is gone; "
            f"stale registry file {registry.job_file(job)})",
            code=2,
        )
    if retries is None:
        return AMClient(address, job, timeout_s=timeout_s)
    return AMClient(address, job, timeout_s=timeout_s, retries=retries)


def dead_local_pid(address: str, pid: Any) -> int | None:
    """``pid`` if the AM is on this host (loopback address) and that process no longer exists."""
    if not isinstance(pid, int) or pid <= 0 or not re.match(r"tcp://(127\.|localhost[:/]|\[::1\])", address):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:
        return None
    return None


def refuse_if_running(job: str, parser: argparse.ArgumentParser) -> None:
    """Exit 2 when an AM for ``job`` is registered and answers (a stale registry entry is ignored)."""
    try:
        client = connect(job, timeout_s=0.5, retries=0)
    except CLIError:
        return  # no entry, an unreadable one, or a dead AM process: the new AM replaces it
    from lightning_elan.protocol.client import AMError, AMUnavailable

    try:
        client.status()
    except (AMError, AMUnavailable):
        return
    finally:
        client.close()
    parser.error(f"job {job} is already running (AM at {client.address})")


def call(client: Any, job: str, request: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``request()`` on ``client``, then close it; an AM that does not answer or replies an error → CLIError."""
    from lightning_elan.protocol.client import AMError, AMUnavailable

    try:
        return request()
    except AMUnavailable:
        raise CLIError(f"job {job}'s AM at {client.address} does not answer", code=2) from None
    except AMError as exc:
        raise CLIError(str(exc), code=1) from None
    finally:
        close = getattr(client, "close", None)
        if callable(close):
            close()
