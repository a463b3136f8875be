"""A SIGTERM that reaches a worker as the job finishes (issue 27): the training loop is over, so there is nothing to
leave and the worker dies of it (exit -15); ``elan run`` still ends 0, because another member's exit 0 shows the
training complete, whichever exit the launcher reports first. The launcher's log calls that death neither expected nor a
failure. Real processes, a real SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests import processes
from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_elan  # noqa: F401

    WORKER = os.environ["ELAN_WORKER_ID"]
    POST_FIT = dict(item.split("=") for item in sys.argv[1].split(","))


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), data)
    print(f"{WORKER} fit done, pid {os.getpid()}", flush=True)
    time.sleep(float(POST_FIT[WORKER]))  # the user's work after fit: saving, evaluating
    """
)


class Output:
    """A running process's combined output, collected line by line."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 240.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if text in line), None)
            if found is not None:
                return found
            time.sleep(0.02)
        raise AssertionError(f"{text!r} never printed:\n{''.join(self.lines)[-4000:]}")

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


@pytest.mark.parametrize("order", ["sigtermed-first", "sigtermed-last"])
def test_a_sigterm_as_the_job_finishes_is_harmless(tmp_path: Path, order: str) -> None:
    """sigtermed-first: w1 is signalled right after its fit returned while w0 is still in its post-fit work, so w1's
    death reaches the AM first and it starts a recovery nobody will check in to (issue 27: 'no survivor checked in',
    exit 1). sigtermed-last: w1 is signalled after w0 exited 0."""
    post_fit = "w0=8,w1=8" if order == "sigtermed-first" else "w0=0,w1=120"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = elan_env(tmp_path)
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "finish",
               "--state-dir", str(tmp_path / "state"), "--", sys.executable, str(script), post_fit]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(job)
    try:
        line = output.wait_for("w1 fit done, pid")  # the workers' prints may share a line
        pid = int(re.search(r"w1 fit done, pid (\d+)", line).group(1))
        if order == "sigtermed-last":
            output.wait_for("w0 (pid ")
        os.kill(pid, signal.SIGTERM)
        returncode = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        processes.kill(processes.wait_gone(processes.mentioning(env["ELAN_HOME"]), 15.0))
    text = output.text()
    (tmp_path / "finish.log").write_text(text)

    assert returncode == 0, text[-4000:]
    assert "job finish finished" in text
    note = "the job recovers without it" if order == "sigtermed-first" else "after the job's training completed"
    assert f"w1 (pid {pid}) was killed by SIGTERM ({note})" in text, text[-4000:]
    assert "(expected)" not in text
