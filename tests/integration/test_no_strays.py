"""No process outlives its job (issue 26, item 3): a SIGKILLed ``elan run`` takes its workers, its standby, its AM and
their DataLoader processes with it; a SIGTERMed worker stuck before its first step leaves by itself after
``--term-grace``. Real processes, real signals; processes are found by pid files and by the job's ``ELAN_HOME`` in their
environment (``tests/processes.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import processes
from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration

GONE_WITHIN_S = 15.0
TERM_GRACE_S = 5.0

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_elan  # noqa: F401

    OUT, WORKER = Path(sys.argv[1]), os.environ["ELAN_WORKER_ID"]
    (OUT / f"worker-{WORKER}.pid").write_text(str(os.getpid()))


    def loader_started(_index):
        (OUT / f"loader-{WORKER}-{os.getpid()}.pid").write_text(str(os.getpid()))


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.2)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            print(f"{WORKER} trained step {self.trainer.global_step}", flush=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    class StuckModel(Model):
        def prepare_data(self):
            (OUT / f"prepare-{WORKER}").write_text("")
            if "--in-cpp" in sys.argv:  # as a rendezvous or a hung collective: the interpreter never gets control back
                from datetime import timedelta
                torch.distributed.HashStore().wait(["never set"], timedelta(days=1))
            time.sleep(10**6)


    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, num_workers=1,
                      persistent_workers=True, worker_init_fn=loader_started)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=30, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(StuckModel() if "--stuck" in sys.argv else Model(), data)
    """
)


class Job:
    """One background ``elan run`` of ``TRAIN``; its combined output is collected line by line."""

    def __init__(self, tmp: Path, name: str, nproc: int, launcher_args: list[str], train_args: list[str]) -> None:
        self.out = tmp / name
        self.out.mkdir()
        self.home = tmp / "elan-home"
        script = tmp / "train.py"
        script.write_text(TRAIN)
        command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
                   "--coordinate-every", "1000", "--state-dir", str(tmp / f"{name}-state"), *launcher_args,
                   "--", sys.executable, str(script), str(self.out), *train_args]
        self.process = subprocess.Popen(command, env=elan_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, predicate, what: str, timeout_s: float = 240.0):
        """Poll ``predicate()`` until it gives something true; fail naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            assert self.process.poll() is None, f"elan run ended ({self.process.returncode}) before {what}:\n" \
                                                f"{self.text()[-4000:]}"
            time.sleep(0.05)
        raise AssertionError(f"never {what}:\n{self.text()[-4000:]}")

    def printed(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def pid_of(self, worker: str) -> int | None:
        path = self.out / f"worker-{worker}.pid"
        return int(path.read_text()) if path.exists() and path.read_text() else None

    def am_pid(self) -> int:
        match = re.search(r"AM of job \S+ \(pid (\d+)\)", self.text())  # what `elan am` says as it starts
        assert match is not None, self.text()[-4000:]
        return int(match.group(1))

    def loader_pids(self) -> set[int]:
        return {int(path.read_text()) for path in self.out.glob("loader-*.pid") if path.read_text()}

    def processes(self) -> set[int]:
        """Every running process of the job: its environment names the job's ELAN_HOME (the launcher included)."""
        return processes.mentioning(f"ELAN_HOME={self.home}")

    def stop(self) -> None:
        """The end of every test: no process of the job is left, whatever happened."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        self._reader.join(timeout=10)
        processes.kill(processes.wait_gone(self.processes(), GONE_WITHIN_S))


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.stop()


def sigterm_caught(pid: int) -> bool:
    """A Python handler for SIGTERM is installed in ``pid`` (the worker's elastic engine has started)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_a_sigkilled_elan_run_leaves_no_process_behind(jobs, tmp_path):
    """2 workers (a DataLoader process each) and a standby train; SIGKILL to ``elan run`` after 3 steps: 15 s later
    no worker, standby, AM or DataLoader process of the job runs."""
    job = Job(tmp_path, "strays", 2, ["--standby", "1"], [])
    jobs.append(job)
    job.wait_for(lambda: job.printed("w0 trained step 3") and job.printed("w1 trained step 3"), "trained 3 steps")
    workers = {worker: job.wait_for(lambda w=worker: job.pid_of(w), f"{worker} started") for worker in
               ("w0", "w1", "w2")}
    assert job.printed("spawned w2 (standby")
    loaders = job.loader_pids()
    expected = {job.am_pid(), *workers.values(), *loaders}
    found = job.processes() - {job.process.pid}
    assert len(loaders) >= 2 and expected <= found, (expected, found)

    job.process.kill()
    job.process.wait()

    left = processes.wait_gone(found, GONE_WITHIN_S)
    assert not left, {pid: processes.command_line(pid) for pid in left}
    assert not job.processes()


@pytest.mark.parametrize("stuck", ["sleeping", "in-cpp"])
def test_a_sigtermed_worker_stuck_before_its_first_step_leaves_after_the_grace_period(jobs, tmp_path, stuck):
    """A user's ``prepare_data`` that never returns — sleeping (the Python handler runs) or waiting in C++ (it never
    does: the watch learns of the SIGTERM from the wakeup fd) — or the ``new_group`` Lightning runs it in, hanging
    first: SIGTERM to that worker ends it ``--term-grace`` (5 s) later, by the crash path it takes itself."""
    job = Job(tmp_path, "stuck", 2, ["--term-grace", f"{TERM_GRACE_S:g}"], ["--stuck", f"--{stuck}"])
    jobs.append(job)
    pid = job.wait_for(lambda: job.pid_of("w1"), "w1 started")
    job.wait_for(lambda: sigterm_caught(pid), "w1's elastic engine started", timeout_s=300)
    time.sleep(2.0)  # into prepare_data, or into the hang before it
    where = "prepare_data" if (job.out / "prepare-w1").exists() else "Lightning's barrier before prepare_data"
    assert processes.running(pid) and not job.printed("trained step"), job.text()[-4000:]

    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    left = processes.wait_gone({pid}, TERM_GRACE_S + 5.0)
    took = time.monotonic() - sent

    assert not left, f"w1 (stuck in {where}) still runs {took:.1f} s after SIGTERM:\n{job.text()[-4000:]}"
    assert TERM_GRACE_S - 0.5 <= took, f"w1 (stuck in {where}) ended {took:.1f} s after SIGTERM"
    crash_path = f"takes the crash path (it has not left the job {TERM_GRACE_S:g} s after SIGTERM)"
    job.wait_for(lambda: job.printed(crash_path), "the crash path logged", timeout_s=10)
    job.wait_for(lambda: job.printed(f"w1 (pid {pid}) was killed by SIGKILL"), "w1's end reported", timeout_s=10)
