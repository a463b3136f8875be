"""A training worker SIGKILLed while its DataLoader's worker processes run their ``worker_init_fn``
(``accelerate_loader_workers_loop.py``): the job goes on without it and ends (exit 0, the static run's parameters),
and the dead worker's loader processes end with it. torch's loader worker watches its parent only from after
``worker_init_fn``: one whose parent died during its init kept running for ever, and with it the pipe of `elan run`'s
output (`subprocess.run(capture_output=True)`, `elan run | tee`: no end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_loader_workers_loop.py")


def command(tmp: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
            "1", "--state-dir", str(tmp / f"{name}-state"), "--", sys.executable, str(LOOP), str(tmp / name)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def loader_pids(out: Path, worker: str) -> list[int]:
    return [int(path.name.rsplit("-", 1)[1]) for path in out.glob(f"loader-{worker}-*")]


def test_a_worker_killed_while_its_loader_workers_start_takes_them_along(tmp_path: Path) -> None:
    static = subprocess.run(command(tmp_path, "static"), capture_output=True, text=True, timeout=300,
                            env=elan_env(tmp_path))
    assert static.returncode == 0, static.stderr[-3000:]

    out = tmp_path / "killed"
    proc = subprocess.Popen(command(tmp_path, "killed"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=elan_env(tmp_path))
    orphans: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (loader_pids(out, "w1") and (out / "pid-w1").exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loader_pids(out, "w1"), "w1's loader workers never started"
        os.kill(int((out / "pid-w1").read_text()), signal.SIGKILL)  # during its loader workers' init
        output, _ = proc.communicate(timeout=240)  # EOF: nobody holds elan run's output any more
        orphans = [pid for pid in loader_pids(out, "w1") if alive(pid)]
        assert proc.returncode == 0, output[-3000:]
        assert not orphans, f"w1's loader workers {orphans} outlived it"
        expected, actual = torch.load(tmp_path / "static" / "final.pt"), torch.load(out / "final.pt")
        for key, value in expected.items():
            assert torch.allclose(actual[key], value, rtol=0, atol=1e-9), key
    finally:
        for pid in [*loader_pids(out, "w0"), *loader_pids(out, "w1")]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
