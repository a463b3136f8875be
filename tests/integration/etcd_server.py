"""A throw-away etcd (Debian's ``etcd-server``, v3 API) for the tests: loopback ports, a temporary data dir, stopped by
PID. ``pause()``/``resume()`` SIGSTOP/SIGCONT it; ``stop()`` then ``start()`` restarts it on the same data dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import pytest

from bench.procs import free_port

LOOPBACK = "127.0.0.1"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd binary, or skip the test with the reason (CI installs it: ``.ci/run``)."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd not installed (apt-get install -y etcd-server; .ci/run installs it)")
    return binary


class PortTaken(RuntimeError):
    """etcd exited because another process bound one of its ports first."""


class EtcdServer:
    """``with EtcdServer(tmp) as etcd:`` starts one etcd member and waits until its v3 gateway answers."""

    def __init__(self, workdir: Path, name: str = "elan-test") -> None:
        self.workdir = workdir
        self.data_dir = workdir / "etcd-data"
        self.log_path = workdir / "etcd.log"
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log_start = 0

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"

    def url(self, prefix: str = "test") -> str:
        return f"etcd://{self.endpoint}/{prefix}"

    def command(self) -> list[str]:
        client, peer = f"http://{LOOPBACK}:{self.client_port}", f"http://{LOOPBACK}:{self.peer_port}"
        return [
            require_etcd(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new", "--log-level", "warn",
        ]

    def start(self, timeout_s: float = 30.0) -> EtcdServer:
        """Start the member; a new one whose port was taken meanwhile starts again on other ports (twice at most)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        fresh = not self.data_dir.exists()
        for attempt in range(3):
            try:
                self._launch(timeout_s)
                return self
            except PortTaken:
                if not fresh or attempt == 2:
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.client_port, self.peer_port = free_port(), free_port()
        return self

    def _launch(self, timeout_s: float) -> None:
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        request = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=b'{"key":"AA=="}',
                                         headers={"Content-Type": "application/json"})
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_path.read_bytes()[self._log_start:].decode(errors="replace")[-2000:]
                kind = PortTaken if "address already in use" in tail else RuntimeError
                raise kind(f"etcd exited with {self.proc.returncode}: {tail}")
            try:
                with urllib.request.urlopen(request, timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"etcd did not answer on {self.endpoint} within {timeout_s:.0f} s")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the member (its data dir stays: ``start()`` restarts it with the same data)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
