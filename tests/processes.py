"""The processes a test started, read from ``/proc``: by pid, by ancestry, or by a path in their environment or command
line (a job's ``ELAN_HOME``, the session's temporary directory). A zombie counts as gone: it holds nothing, and an
orphan's waits for init to reap it. Other users' processes (unreadable) are never matched."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None once the process is gone."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def parents() -> dict[int, int]:
    """Every running process's parent pid."""
    found = {}
    for pid in pids():
        fields = _stat(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            found[pid] = int(fields[1])
    return found


def descendants(root: int) -> set[int]:
    """The running processes below ``root`` (children, grandchildren, …)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of each of its threads), none once it is gone."""
    found: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the thread or the process ended meanwhile
            continue
    return found


def launched_by(launcher: int) -> list[int]:
    """The children of an ``elan run`` process, with the workers its preload process (``elan-preload``) forked in
    place of the preload process itself."""
    direct = children(launcher)
    preloads = [child for child in direct if (argv(child) or [b""])[0] == b"elan-preload"]
    return [child for child in direct if child not in preloads] + [
        worker for preload in preloads for worker in children(preload)]


def argv(pid: int) -> list[bytes] | None:
    """A running (not zombie) process's argument vector, else None."""
    command = _read(pid, "cmdline")
    return command.split(b"\0") if command and running(pid) else None


def _read(pid: int, name: str) -> bytes:
    try:
        return (PROC / str(pid) / name).read_bytes()
    except OSError:  # gone, a kernel thread, or another user's
        return b""


def mentioning(text: str) -> set[int]:
    """The running processes (of this user) whose environment or command line contains ``text``."""
    needle = text.encode()
    return {pid for pid in pids()
            if (needle in _read(pid, "environ") or needle in _read(pid, "cmdline")) and running(pid)}


def command_line(pid: int) -> str:
    return _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


SPAWNED = re.compile(r"spawned (\S+) \(.*?pid (\d+)\)")  # `elan run`'s log line for each worker it starts


def spawned_workers(launcher_output: str) -> dict[str, int]:
    """``{worker id: pid}`` of the workers ``elan run``'s output says it started (a worker forked from its preload
    process has the launcher's environment in ``/proc/PID/environ``: its ``ELAN_WORKER_ID`` is not there)."""
    return {worker: int(pid) for worker, pid in SPAWNED.findall(launcher_output)}


def runs_script(pid: int, script: str | Path) -> bool:
    """Whether ``pid`` is a running process whose command line names ``script`` (a worker of that script, not a pid
    reused after it exited)."""
    return running(pid) and str(script).encode() in _read(pid, "cmdline")


def wait_gone(candidates: Iterable[int], timeout_s: float) -> set[int]:
    """Wait until none of ``candidates`` runs or ``timeout_s`` passes; return those still running."""
    deadline = time.monotonic() + timeout_s
    left = {pid for pid in candidates if running(pid)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {pid for pid in left if running(pid)}
    return left


def send(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``: whether it was still there to receive it."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill(candidates: Iterable[int]) -> None:
    """SIGKILL each of ``candidates`` still running (a pid that is gone meanwhile is skipped)."""
    for pid in candidates:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
