"""Process helpers: free loopback ports, child processes in their own session, killed by PID on every exit path."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent


# Ports the kernel hands out itself (a bind to port 0, every outgoing connection) come from the ephemeral range,
# /proc/sys/net/ipv4/ip_local_port_range (32768-60999 by default). A port picked there and handed to a server that
# binds it a moment later races with every connection opened meanwhile; a port picked below that range races only
# with another picker choosing the same number at random.
PICKED_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback TCP port free now, below the kernel's ephemeral range (a server started with it seconds later)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(PICKED_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PICKED_PORTS.start}-{PICKED_PORTS.stop - 1}")


# user-facing settings of the library that pass from the harness's environment to the jobs it starts
USER_KNOBS = ("ELAN_REPLICATION", "ELAN_SHM_DIR")


def bench_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every process the harness starts: repo on the path, gloo on loopback, quiet warnings."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("ELAN_", "TORCHELASTIC_")) or key in USER_KNOBS}  # fmt: skip
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")  # 2-3 workers share 2 cores: one thread each, for every launcher
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    return env


TRAIN_MODULE = "bench.train"


def train_command(*args: str, module: str = TRAIN_MODULE) -> list[str]:
    """The workload's command line: Lightning's ``bench.train`` or Accelerate's ``bench.accelerate_train``."""
    return [sys.executable, "-m", module, *args]


class Children:
    """Every process the harness started; :meth:`stop_all` ends them (and their process groups) by PID."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(self, command: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as output:
            proc = subprocess.Popen(
                list(command), env=dict(env), cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(proc)
        log.debug("started pid %d: %s", proc.pid, " ".join(command))
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = 10.0) -> int:
        """SIGTERM the process's group (its own session: only its descendants), SIGKILL after ``grace_s``."""
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM for %.0f s: SIGKILL", proc.pid, grace_s)
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in its group (e.g. a torchrun worker)
        return int(proc.returncode)

    def stop_all(self) -> None:
        for proc in self._procs:
            self.stop(proc, grace_s=5.0)
        self._procs.clear()


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_strays(pids: Iterable[int], marker: str = "bench.train") -> list[int]:
    """SIGKILL the processes among ``pids`` that still run our ``marker`` command (torchrun starts its workers in
    process groups of their own, so stopping an agent's group can leave a wedged worker behind)."""
    killed = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    if killed:
        log.warning("killed stray worker processes %s", killed)
    return killed


def wait_all(procs: Iterable[subprocess.Popen], timeout_s: float, poll_s: float = 0.005) -> list[int]:
    """Wait until every process has exited; raise ``TimeoutError`` after ``timeout_s``."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {[p.pid for p in procs if p.poll() is None]} still running")
        time.sleep(poll_s)
    return [int(proc.returncode) for proc in procs]
