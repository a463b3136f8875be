"""A worker that leaves the job during ``fit`` ends its script once its ``fit`` has returned: exit 0, its ``finally:``
blocks run, the script's code after ``fit`` does not (it would see the worker's state as it was when it left: a
``trainer.test``, a result file, a reload of the best checkpoint), as if the job had been launched at its final size.
The launcher counts the exit as the leave it waited for; the job's members run the code after ``fit`` with the final
state. Real ``elan run`` jobs of an ordinary user script (``user_scripts/after_fit_outputs.py``), real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "after_fit_outputs.py"
STEPS = 30  # 3 epochs of 120 samples, global batch 12 (3 workers x 4): kept when the job shrinks


def elan_command(tmp_path: Path, name: str, schedule: str | None, script: Path = SCRIPT) -> list[str]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "3", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp_path / f"{name}-state")]
    if schedule:
        command += ["--schedule", schedule]
    return [*command, "--", sys.executable, str(script), str(tmp_path / name)]


class Job:
    """A running ``elan run``; a thread collects its combined output line by line."""

    def __init__(self, tmp_path: Path, name: str, schedule: str | None = None, script: Path = SCRIPT) -> None:
        self.tmp_path, self.name = tmp_path, name
        self.process = subprocess.Popen(elan_command(tmp_path, name, schedule, script), env=elan_env(tmp_path),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 240.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} never printed:\n{''.join(self.lines)[-4000:]}")

    def finish(self) -> str:
        try:
            self.process.wait(timeout=600)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=60)
        output = "".join(self.lines)
        (self.tmp_path / f"{self.name}.log").write_text(output)
        return output


def spawned_pids(output: str) -> dict[str, int]:
    """``wN -> pid`` from the launcher's ``spawned wN (member, rank R of N, pid P)`` lines."""
    return {worker: int(pid) for worker, pid in re.findall(r"spawned (w\d+) \(.*?pid (\d+)\)", output)}


def leavers(tmp_path: Path, name: str) -> list[list[str]]:
    path = tmp_path / f"{name}-state" / "adjustments.jsonl"
    return [json.loads(line)["leavers"] for line in path.read_text().split("\n") if line.strip()]


def outputs(out: Path, kind: str) -> dict[int, dict]:
    return {int(path.stem.rsplit("-", 1)[1]): json.loads(path.read_text()) for path in out.glob(f"{kind}-*.json")}


def assert_leaver_ended_after_fit(tmp_path: Path, name: str, output: str, returncode: int, leaver: str) -> None:
    """The leaver's ``finally:`` ran, its code after ``fit`` did not, it exited 0 as an expected leave; the two
    members ran the code after ``fit`` with the job's final state; the job exited 0."""
    assert returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    pids = spawned_pids(output)
    assert sorted(pids) == ["w0", "w1", "w2"], output[-4000:]
    assert leavers(tmp_path, name) == [[leaver]]
    leaver_pid = pids[leaver]
    members = sorted(pid for worker, pid in pids.items() if worker != leaver)
    out = tmp_path / name
    assert sorted(outputs(out, "finally")) == sorted(pids.values()), "every worker's finally: ran"
    after_fit, tested = outputs(out, "after-fit"), outputs(out, "tested")
    assert leaver_pid not in after_fit and leaver_pid not in tested, "the leaver ran the script's code after fit"
    assert sorted(after_fit) == sorted(tested) == members
    assert sorted(after_fit[pid]["rank"] for pid in members) == [0, 1]
    assert {(after_fit[pid]["world_size"], after_fit[pid]["global_step"]) for pid in members} == {(2, STEPS)}
    assert after_fit[members[0]]["parameters"] == after_fit[members[1]]["parameters"]
    assert all(len(tested[pid]["results"]) == 1 for pid in members)
    assert f"{leaver} (pid {leaver_pid}) exited with code 0 (expected)" in output, output[-4000:]
    assert f"worker {leaver} left the job during fit: its script ends here" in output, output[-4000:]
    assert re.search(rf"job {name} finished", output), output[-4000:]


@pytest.mark.parametrize("tree", ["lightning.pytorch", "pytorch_lightning"])
def test_a_worker_removed_by_the_schedule_ends_its_script_after_fit(tmp_path: Path, tree: str) -> None:
    """``--schedule 5:remove=1`` on 3 workers: the removed worker's script ends once its ``fit`` returned; the same
    with the script written against the classic ``pytorch_lightning``."""
    script = SCRIPT
    if tree == "pytorch_lightning":
        source = SCRIPT.read_text()
        assert "import lightning.pytorch as pl" in source
        script = tmp_path / SCRIPT.name
        script.write_text(source.replace("import lightning.pytorch as pl", "import pytorch_lightning as pl"))
    job = Job(tmp_path, "removed", "5:remove=1", script)
    output = job.finish()
    (leaver,) = leavers(tmp_path, "removed")[0]
    assert_leaver_ended_after_fit(tmp_path, "removed", output, job.process.returncode, leaver)


def test_a_worker_sigtermed_during_fit_ends_its_script_after_fit(tmp_path: Path) -> None:
    """SIGTERM to rank 1's process at its step 3: it leaves at a batch boundary and its script ends after ``fit``."""
    job = Job(tmp_path, "sigterm")
    found = job.wait_for(r"rank 1 pid (\d+) trained step 3(?!\d)")  # processes share the pipe: a line may run on
    os.kill(int(found.group(1)), signal.SIGTERM)
    output = job.finish()
    leaver = next(worker for worker, pid in spawned_pids(output).items() if pid == int(found.group(1)))
    assert_leaver_ended_after_fit(tmp_path, "sigterm", output, job.process.returncode, leaver)
