"""A throw-away one-node Slurm cluster (Debian's ``slurm-wlm`` and ``munge``) for the recipe test: munged, slurmctld
and slurmd started in the foreground from a temporary directory (their own key, socket, state, spool and loopback
ports), ``proctrack/linuxproc`` and ``task/none`` so no cgroup is needed, stopped by PID. Needs root (slurmd runs the
jobs' tasks as their users); the test is skipped with the reason where that or a binary is missing."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest

from tests.integration.elastic_runs import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
NODE_CPUS = 8  # more than this 2-core machine has (config_overrides): an elastic job's workers oversubscribe it


def require_slurm() -> None:
    """Skip the test with the reason where a one-node cluster cannot be started here."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing; apt-get install -y slurm-wlm munge — "
                    ".ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("a one-node Slurm cluster needs root here (slurmd starts the jobs' tasks)")


class SlurmCluster:
    """``with SlurmCluster(tmp) as slurm:`` one node named after this host, one partition; ``slurm.env`` is the
    environment (``SLURM_CONF``) under which ``sbatch``/``scancel``/``scontrol`` talk to it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmCluster:
        try:
            self._prepare()
            root = self.root
            self._start("munged", ["munged", "-F", "-f", f"--key-file={root / 'munge.key'}",
                                   f"--socket={self._munge_socket}", f"--pid-file={root / 'munged.pid'}",
                                   f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"])
            self._wait_for(lambda: self._munge_socket.exists(), "munged's socket")
            self._start("slurmctld", ["slurmctld", "-D", "-i"])
            self._start("slurmd", ["slurmd", "-D", "-N", self.node])
            self._wait_for(self._node_idle, "the node to be idle")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """Submit ``script ARGS``; returns the job id."""
        command = ["sbatch", "--parsable", *options, str(script), *args]
        done = subprocess.run(command, env={**(env or os.environ), **self._slurm_env}, cwd=cwd, capture_output=True,
                              text=True, timeout=30, check=True)
        return done.stdout.strip().split(";")[0]

    def scancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], env=self.env, check=True, timeout=30)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, …); finished jobs stay listed for MinJobAge."""
        done = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True, text=True,
                              timeout=30, check=True)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_finished(self, job_id: str, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (fields := self.job(job_id))["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} still {fields['JobState']} after {timeout_s:.0f} s")
            time.sleep(0.5)
        return fields

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.root.glob("*.log")))

    # ------------------------------------------------------------------ the daemons

    @property
    def _munge_socket(self) -> Path:
        return self.root / "munge.socket"

    @property
    def _slurm_env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _prepare(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # munged wants its socket's directory searchable by everyone
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(self._config())

    def _config(self) -> str:
        root = self.root
        return "\n".join([
            "ClusterName=elantest", f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={self._munge_socket}", "CredType=cred/munge",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "KillWait=60",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", "",
        ])

    def _start(self, name: str, command: list[str]) -> None:
        log = (self.root / f"{name}.out.log").open("w")
        self._daemons.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _node_idle(self) -> bool:
        for daemon in self._daemons:
            if daemon.poll() is not None:
                raise RuntimeError(f"{daemon.args[0]} exited with code {daemon.returncode}:\n{self.logs()}")
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                              timeout=30)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _wait_for(self, ready, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm test cluster: no {what} after {timeout_s:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def close(self) -> None:
        """Cancel what still runs, then stop the daemons (slurmd, slurmctld, munged) by PID."""
        if self._daemons:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self._daemons.clear()
