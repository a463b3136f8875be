"""A worker that crashes while its interpreter shuts down, after its script ended (a C++ destructor or a library thread
aborting: seen in CI as "terminate called without an active exception" once `Trainer.fit` had returned), finished: the
job ends 0 with a warning naming the crash. One whose script ended in an uncaught exception did not: the job fails.
A user script, real processes, a real SIGABRT (``os.abort`` from an exit handler that runs after every other one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import processes
from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration

TRAIN = textwrap.dedent(
    """
    import atexit, os, sys

    ENDING = sys.argv[1]
    if os.environ["ELAN_WORKER_ID"] == "w1":
        atexit.register(os.abort)  # registered first, so it runs last: after every library's exit hook

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_elan  # noqa: F401


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), data)
    if ENDING == "raised" and os.environ["ELAN_WORKER_ID"] == "w1":
        raise RuntimeError("the user's evaluation after fit failed")
    """
)


def run_job(tmp_path: Path, ending: str) -> tuple[int, str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = elan_env(tmp_path)
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "teardown",
               "--state-dir", str(tmp_path / "state"), "--", sys.executable, str(script), ending]
    try:
        job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    finally:
        processes.kill(processes.wait_gone(processes.mentioning(env["ELAN_HOME"]), 15.0))
    text = job.stdout + job.stderr
    (tmp_path / "teardown.log").write_text(text)
    return job.returncode, text


def test_a_crash_after_the_script_ended_counts_as_finished(tmp_path: Path) -> None:
    returncode, text = run_job(tmp_path, "finished")
    assert returncode == 0, text[-4000:]
    assert "was killed by SIGABRT after its script had ended (a crash while the interpreter shut down): " \
           "counted as finished" in text, text[-4000:]
    assert "job teardown finished" in text


def test_a_crash_after_an_uncaught_exception_fails_the_job(tmp_path: Path) -> None:
    returncode, text = run_job(tmp_path, "raised")
    assert returncode != 0, text[-4000:]
    assert "the user's evaluation after fit failed" in text
    assert "counted as finished" not in text
