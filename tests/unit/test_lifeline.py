"""Children that die with the process that started them (``launcher/lifeline.py``): real processes, real SIGKILLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_elan.launcher.lifeline import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from lightning_elan.launcher.lifeline import die_with_parent

    child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent(signal.SIG{signal}))
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("signame", ["KILL", "TERM"])
def test_the_child_dies_with_its_sigkilled_parent(signame: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(signal=signame)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert running(child)
        parent.kill()
        parent.wait()
        assert wait_gone(child), f"child {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if child and running(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getpid", lambda: 1)  # the parent the preexec_fn expects is not the one it finds
    preexec = die_with_parent(signal.SIGKILL)
    monkeypatch.undo()

    child = subprocess.Popen(["sleep", "600"], preexec_fn=preexec)
    try:
        assert child.wait(timeout=30) == 128 + signal.SIGKILL
    finally:
        child.kill()
        child.wait()
