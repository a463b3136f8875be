"""A throw-away local etcd (Debian's ``etcd-server``) on loopback ports, with the v2 API torch's rendezvous needs."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from bench.procs import LOOPBACK, free_port

log = logging.getLogger(__name__)


class EtcdServer:
    """``with EtcdServer(dir) as etcd:`` starts etcd, waits until it answers, and stops it by PID on exit."""

    def __init__(self, data_dir: Path, name: str = "bench") -> None:
        self.data_dir = data_dir
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def client_endpoint(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"

    def command(self) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not found: apt-get install -y etcd-server")
        client, peer = f"http://{LOOPBACK}:{self.client_port}", f"http://{LOOPBACK}:{self.peer_port}"
        return [
            binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--enable-v2=true", "--log-level", "warn",
        ]

    def __enter__(self) -> EtcdServer:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True)
        log_file = (self.data_dir.parent / "etcd.log").open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()
        self._wait_ready(30.0)
        log.info("etcd (pid %d) on %s", self.proc.pid, self.client_endpoint)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.client_endpoint}/v2/keys"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} (see {self.data_dir.parent}/etcd.log)")
            try:
                with urllib.request.urlopen(url, timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"etcd did not answer on {url} in {timeout_s:.0f} s")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log.info("etcd (pid %d) stopped", self.proc.pid)
        self.proc = None
        shutil.rmtree(self.data_dir, ignore_errors=True)
