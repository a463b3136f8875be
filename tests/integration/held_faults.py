"""The test's side of ``hold_point.py``: run a job whose members hold at a phase of one step, SIGKILL the victim from
outside once every member is there, and let the job go on.

The kill is a real ``os.kill(pid, SIGKILL)`` of the victim's process (checked to be that worker of this job), sent when
every member of the generation wrote its ``held-<worker>.json`` — plus a settling pause, so survivors that mark and go
on (``allreduce``) are inside their all-reduce by then.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import processes
from tests.integration.accelerate_runs import PROBE as ACCELERATE_PROBE
from tests.integration.elastic_runs import PROBE, PROBE_ARGS, RunResult, elan_env
from tests.integration.hold_point import RELEASED

SETTLE_S = 0.5  # after every member arrived: the survivors that went on into their all-reduce are blocked in it
ARRIVAL_LIMIT_S = 240.0


@dataclass
class HeldKill:
    """Whom the killer thread kills and what it did: the victim's pid and when it was killed (None: the members never
    all arrived). ``also``: members killed too, ``also_after_s`` after the victim (two deaths within a second)."""

    victim: str
    members: int
    settle_s: float = SETTLE_S
    also: tuple[str, ...] = ()
    also_after_s: float = 0.5
    pid: int | None = None
    killed_at: float | None = None
    arrived: list[str] = field(default_factory=list)

    @property
    def dead(self) -> list[str]:
        return [self.victim, *self.also]


def held_lightning_run(tmp: Path, name: str, nproc: int, hold: str, members: int, launcher_args: tuple[str, ...] = (),
                       probe_args: tuple[str, ...] = (), **kill: Any) -> tuple[RunResult, HeldKill]:
    """``elan run`` of the Lightning probe (global batch 12, as the static run) holding at ``hold``; ``kill``: the
    other fields of :class:`HeldKill`."""
    command = [*_elan_run(tmp, name, nproc, launcher_args), sys.executable, str(PROBE), "--out", str(tmp / name),
               *PROBE_ARGS, "--global-batch", "12", "--hold-at", hold, *probe_args]
    return run_with_hold(tmp, name, command, HeldKill(hold.split(":")[0], members, **kill))


def held_accelerate_run(tmp: Path, name: str, nproc: int, hold: str, members: int, args: list[str],
                        schedule: str | None = None, **kill: Any) -> tuple[RunResult, HeldKill]:
    """``elan run`` of the Accelerate probe holding at ``hold``."""
    launcher = ("--schedule", schedule) if schedule else ()
    command = [*_elan_run(tmp, name, nproc, launcher), sys.executable, str(ACCELERATE_PROBE), "--out",
               str(tmp / name), *args, "--hold-at", hold]
    return run_with_hold(tmp, name, command, HeldKill(hold.split(":")[0], members, **kill))


def _elan_run(tmp: Path, name: str, nproc: int, launcher_args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
            "--coordinate-every", "1", "--state-dir", str(tmp / f"{name}-state"), *launcher_args, "--"]


def run_with_hold(tmp: Path, name: str, command: list[str], kill: HeldKill,
                  timeout: float = 300) -> tuple[RunResult, HeldKill]:
    """Run ``command`` (its probe writes to ``tmp/name``) while a thread SIGKILLs ``kill``'s victims."""
    out = tmp / name
    out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_held, args=(out, kill, stop), daemon=True)
    job = subprocess.Popen(command, env=elan_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer.start()
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang: the job is stopped, its output kept, and the run fails
        job.send_signal(signal.SIGINT)
        output, _ = job.communicate(timeout=60)
        output += f"\n[the test stopped the job: still running after {timeout:.0f} s]\n"
    finally:
        stop.set()
        if job.poll() is None:
            job.kill()
            job.communicate()
        killer.join(timeout=5)
    (tmp / f"{name}.log").write_text(output)
    return RunResult(out, tmp / f"{name}-state", job.returncode if job.returncode is not None else -9, output), kill


def _kill_when_held(out: Path, kill: HeldKill, stop: threading.Event) -> None:
    deadline = time.monotonic() + ARRIVAL_LIMIT_S
    while not stop.is_set() and time.monotonic() < deadline:
        kill.arrived = sorted(path.stem.removeprefix("held-") for path in out.glob("held-*.json"))
        if len(kill.arrived) >= kill.members:
            break
        time.sleep(0.02)
    else:
        return
    time.sleep(kill.settle_s)
    (out / RELEASED).write_text(str(time.time()))  # first: the survivors' redo of the step holds no more
    kill.pid = _kill_worker(out, kill.victim)
    kill.killed_at = time.time()
    if kill.also:
        time.sleep(kill.also_after_s)
        for worker in kill.also:
            _kill_worker(out, worker)


def _kill_worker(out: Path, worker: str) -> int:
    pid = json.loads((out / f"held-{worker}.json").read_text())["pid"]
    _check_is_worker(pid, worker)
    os.kill(pid, signal.SIGKILL)
    return pid


def _check_is_worker(pid: int, worker: str) -> None:
    """Never SIGKILL a process that is not the victim worker (a pid reused after an unexpected exit): the pid the
    worker wrote down must still run one of the probes."""
    if not any(processes.runs_script(pid, probe) for probe in (PROBE, ACCELERATE_PROBE)):
        raise RuntimeError(f"pid {pid} is not worker {worker}: not killed")
