"""The application master as a child process of ``elan run``: started, watched, restarted from its store, stopped.

The AM runs as ``python -m lightning_elan.cli am --job NAME --bind ADDR --state-dir D --parent-pid P`` in a session of
its own (a Ctrl-C at the terminal reaches the launcher, which stops the AM itself). Its first start binds a free
port; every restart binds the same address, so workers (ZeroMQ DEALERs reconnect by themselves) and ``elan
scale/status`` (the registry entry is rewritten with the new pid) reach the new AM without being told. The new AM
resumes from ``state.json``; clients resend with the same message id and the persisted reply cache answers replays.

The AM dies with its launcher: when ``elan run`` ends in any way, SIGKILL included, the kernel sends the AM SIGTERM
(``launcher/lifeline.py``) and it stops as on Ctrl-C (registry entry removed, state kept in the state directory for the
next ``elan run`` to archive); its ``--parent-pid`` watch (it polls ``getppid``) is the fallback. An AM nobody's
``elan run`` started — ``elan am``, a standby AM on an etcd store — is nobody's child and runs until it is stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from lightning_elan.launcher.lifeline import die_with_parent
from lightning_elan.master import registry
from lightning_elan.master.narration import plural

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 20
FIRST_BIND = "tcp://127.0.0.1:0"
QUICK_DEATH_S = 1.0
"""An AM that dies sooner than this after its start is restarted only after ``RESTART_BACKOFF_S`` (e.g. its port
was briefly taken), so a crash loop does not spend the restart budget in a second."""
RESTART_BACKOFF_S = 0.5


class AMFailed(RuntimeError):
    """The AM could not be started, or died more often than the restart budget allows."""


class _KilledWhileStarting(AMFailed):
    """A signal from outside ended the AM before it registered (not a crash of its own): it is started again."""


class AMProcess:
    """One job's AM child process; :meth:`check` restarts it when it died without being asked to stop."""

    def __init__(
        self,
        job: str,
        state_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.job = job
        self.state_dir = Path(state_dir)
        self.max_restarts = max_restarts
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0
        self._env = dict(os.environ if env is None else env)
        self._address: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0

    @property
    def address(self) -> str:
        """The AM's ZeroMQ address, the same for every restart."""
        if self._address is None:
            raise RuntimeError("the AM process is not started")
        return self._address

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> str:
        """Start the AM on a free port and wait until it has registered its address; returns the address. An AM
        killed by a signal before it registered is started again (a restart of the budget); one that exits with a
        code of its own (bad options, an import error) fails the start."""
        while True:
            process = self._spawn(FIRST_BIND)
            try:
                self._address = self._await_registration(process)
            except _KilledWhileStarting as killed:
                self._count_restart(str(killed), "starting it again")
                continue
            log.debug("job %s: AM process %d listening on %s", self.job, process.pid, self._address)
            return self._address

    def check(self) -> bool:
        """Restart the AM from its store if it has exited; True when it did. Raises ``AMFailed`` past the budget."""
        process = self._process
        if process is None or process.poll() is None:
            return False
        how = f"the AM of job {self.job} (pid {process.pid}) {describe_status(process.returncode)}"
        self._count_restart(how, f"restarting it from its store in {self.state_dir}")
        if time.monotonic() - self._started_at < QUICK_DEATH_S:
            time.sleep(RESTART_BACKOFF_S)
        restarted = self._spawn(self.address)
        log.info("job %s: AM restarted as process %d on %s", self.job, restarted.pid, self.address)
        return True

    def _count_restart(self, how: str, action: str) -> None:
        """One more restart after ``how`` (the AM's end), within the budget; raises ``AMFailed`` past it."""
        if self.restarts >= self.max_restarts:
            raise AMFailed(f"{how}; it was already restarted {plural(self.restarts, 'time')}, the most allowed: "
                           "giving up")
        self.restarts += 1
        log.warning("%s; %s (restart %d of at most %d)", how, action, self.restarts, self.max_restarts)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the AM (it removes its registry entry), SIGKILL it after ``grace_s``; log how it ended."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("the AM of job %s (pid %d) ignored SIGTERM for %.0f s: killing it", self.job,
                            process.pid, grace_s)
                process.kill()
                process.wait()
        log.info("the AM of job %s (pid %d) %s", self.job, process.pid, describe_status(process.returncode))

    def _spawn(self, bind: str) -> subprocess.Popen[bytes]:
        self._process = subprocess.Popen(self._command(bind), env=self._env, start_new_session=True,
                                         preexec_fn=die_with_parent(signal.SIGTERM, hold_sigterm=True))
        self._started_at = time.monotonic()
        return self._process

    def _command(self, bind: str) -> list[str]:
        return [
            sys.executable, "-m", "lightning_elan.cli", "am", "--job", self.job, "--bind", bind,
            "--state-dir", str(self.state_dir), "--parent-pid", str(os.getpid()),
        ]

    def _await_registration(self, process: subprocess.Popen[bytes]) -> str:
        """The address the AM wrote to the job registry (the entry naming its pid)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            entry = _read_registry(self.job)
            if entry is not None and entry.get("pid") == process.pid and entry.get("address"):
                return str(entry["address"])
            if process.poll() is not None:
                failure = _KilledWhileStarting if process.returncode < 0 else AMFailed
                raise failure(f"the AM of job {self.job} (pid {process.pid}) {describe_status(process.returncode)} "
                              "while starting")
            time.sleep(0.02)
        process.kill()
        process.wait()
        raise AMFailed(f"the AM of job {self.job} did not register within {self.ready_timeout_s:.0f} s")


def _read_registry(job: str) -> dict[str, object] | None:
    try:
        return registry.read(job)
    except (OSError, ValueError):  # not written yet, or being replaced
        return None


def describe_status(returncode: int | None) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL`` / ``is running``."""
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


__all__ = ["DEFAULT_MAX_RESTARTS", "AMFailed", "AMProcess", "describe_status"]
