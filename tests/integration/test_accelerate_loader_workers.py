"""A training worker SIGKILLed while its DataLoader's worker processes run their ``worker_init_fn``
(``accelerate_loader_workers_loop.py``): the job goes on without it and ends (exit 0, the static run's parameters),
and the dead worker's loader processes end with it. torch's loader worker watches its parent only from after
``worker_init_fn``: one whose parent died during its init kept running for ever, and with it the pipe of `elan run`'s
output (`subprocess.run(capture_output=True)`, `elan run | tee`: no end). A training worker SIGTERMed with its loader
processes, as ``scancel`` or a machine's shutdown signals every process, leaves the job at a batch boundary (exit 0,
no failure, nothing redone) while its loader processes serve it to the end."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def static_final(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("loader-workers-static")
    static = subprocess.run(command(tmp, "static"), capture_output=True, text=True, timeout=300, env=elan_env(tmp))
    assert static.returncode == 0, static.stderr[-3000:]
    return torch.load(tmp / "static" / "final.pt")


def assert_static_result(final: Path, expected: dict[str, torch.Tensor]) -> None:
    actual = torch.load(final)
    for key, value in expected.items():
        assert torch.allclose(actual[key], value, rtol=0, atol=1e-9), key


def test_a_worker_killed_while_its_loader_workers_start_takes_them_along(tmp_path: Path, static_final) -> None:
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
        assert_static_result(out / "final.pt", static_final)
    finally:
        for pid in [*loader_pids(out, "w0"), *loader_pids(out, "w1")]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_sigtermed_with_its_loader_workers_leaves_at_a_batch_boundary(tmp_path: Path, static_final) -> None:
    out = tmp_path / "termed"
    proc = subprocess.Popen(command(tmp_path, "termed"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=elan_env(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while len(loader_pids(out, "w1")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, loaders = int((out / "pid-w1").read_text()), loader_pids(out, "w1")
        assert len(loaders) == 2, "w1's loader workers never started"
        for signalled in (pid, *loaders):  # one of them may still be in its worker_init_fn
            os.kill(signalled, signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-3000:]
        assert f"w1 (pid {pid}) exited with code 0 (expected)" in output, output[-3000:]
        adjustments = (tmp_path / "termed-state" / "adjustments.jsonl").read_text().splitlines()
        assert [json.loads(line)["action"] for line in adjustments] == ["leave"], adjustments
        assert_static_result(out / "final.pt", static_final)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
