"""SIGTERM to a worker of a real `elan run` job (issue 10, item 3): it leaves at the next batch boundary, exits 0, and
the job goes on with nothing redone. Real signals (``os.kill`` of the worker process), real gloo processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests import processes
from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE_ARGS,
    SAMPLES,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_each_sample_once,
    assert_every_trained_batch_ends_where_it_trained,
    assert_ranks_agree,
    assert_states_close,
    elan_env,
    epoch_ends,
    wait_for_status,
)

pytestmark = pytest.mark.integration

COORDINATE_EVERY = 50  # more than the job's 27 steps: any adjustment is the SIGTERM's, not a scheduled coordination


def read_progress(out: Path, worker: str) -> dict | None:
    """The probe's ``progress-<worker>.json``: the last step the worker completed and its pid."""
    try:
        return json.loads((out / f"progress-{worker}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for_progress(out: Path, worker: str, step: int, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = read_progress(out, worker)
        if progress is not None and progress["step"] >= step:
            return progress
        time.sleep(0.02)
    raise AssertionError(f"{worker} never completed step {step}; last progress {read_progress(out, worker)}")


def pids_by_worker(status: dict) -> dict[str, int]:
    return {member["worker_id"]: member["pid"] for member in status["members"]}


@pytest.mark.every_case
@pytest.mark.parametrize("with_loader_workers", [False, True], ids=["worker", "worker-and-its-dataloader-workers"])
def test_sigterm_makes_a_worker_leave_at_the_next_batch_boundary(static_run, live_job, tmp_path, with_loader_workers):
    """3 workers, global batch 12 (the static run's), coordination every 50 steps: SIGTERM to rank 1 at step ≥ 3.
    It leaves at the boundary right after the signal (not at a multiple of 50), exits 0, and the job ends exactly as
    the static run does: every sample once per epoch, no step redone, the same final parameters. The second case
    trains with two DataLoader worker processes and signals them too, at once, as ``scancel`` or a machine's shutdown
    does: they keep serving batches until the worker has left (killed, they would crash it mid-step)."""
    name, out = "term", tmp_path / "term"
    probe_args = [*PROBE_ARGS, "--global-batch", "12", "--step-sleep", "0.3", "--progress"]
    probe_args += ["--num-workers", "2"] if with_loader_workers else []
    job, env = live_job(name, 3, probe_args, coordinate_every=COORDINATE_EVERY)
    status = wait_for_status(env, name, lambda s: s["members"] and all(m["pid"] for m in s["members"]))
    pid = pids_by_worker(status)["w1"]
    assert [m["worker_id"] for m in status["members"]] == ["w0", "w1", "w2"] and status["members"][1]["rank"] == 1

    wait_for_progress(out, "w1", 3)
    before = read_progress(out, "w1")
    assert before is not None and before["pid"] == pid
    loader_workers = processes.children(pid) if with_loader_workers else []
    assert len(loader_workers) == (2 if with_loader_workers else 0), loader_workers
    for signalled in (pid, *loader_workers):
        os.kill(signalled, signal.SIGTERM)
    output = job.communicate(timeout=600)[0]
    (tmp_path / f"{name}.log").write_text(output)

    run = RunResult(out, tmp_path / f"{name}-state", job.returncode, output)
    assert run.returncode == 0, run.excerpt()
    assert f"w1 (pid {pid}) exited with code 0 (expected)" in output
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
    assert_every_trained_batch_ends_where_it_trained(records)

    (adjustment,) = run.adjustments()
    assert (adjustment["action"], adjustment["leavers"], adjustment["members"]) == ("leave", ["w1"], ["w0", "w2"])
    # w1 had trained step s when it was signalled: it leaves at the boundary after step s + 1, or s + 2 when that step
    # ended before the AM had queued the leave (or even at s's own boundary, when the signal and the AM's answer came
    # before w1 reached it); one step more when that boundary ended an epoch, where an adjustment waits a batch
    first = before["step"] + 1
    latest = first + 1 + any(step in epoch_ends(EPOCHS) for step in (first, first + 1))
    assert before["step"] <= adjustment["step"] <= latest, (before, adjustment["step"])
    assert adjustment["step"] % COORDINATE_EVERY != 0

    by_worker = {record["worker"]: record for record in records}
    leaver = by_worker["w1"]
    assert leaver["left"] and leaver["rank"] == -1 and leaver["global_step"] == adjustment["step"]
    for worker, record in by_worker.items():  # no step redone: each worker trained every step it saw once
        steps = [step for step, _world, _rank, _digest in record["digests"]]
        last = adjustment["step"] if worker == "w1" else EPOCHS * STEPS_PER_EPOCH
        assert steps == list(range(last)), f"{worker} trained steps {steps}"


# an ordinary user's script: it knows nothing of elan but strategy="elan"
USER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_elan  # noqa: F401


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.1)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            print(f"trained step {self.trainer.global_step}", flush=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=30, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), data)
    print(f"done: steps={trainer.global_step} rank={trainer.global_rank} world={trainer.world_size}", flush=True)
    """
)


class OutputReader:
    """Collects a running job's combined output line by line (a thread drains the pipe)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if text in line), None)
            if found is not None:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never printed:\n{''.join(self.lines)[-4000:]}")

    def text(self) -> str:
        self._thread.join(timeout=60)
        return "".join(self.lines)


def test_a_users_script_loses_rank0_and_a_warming_joiner_to_sigterm(tmp_path):
    """A plain user script under `elan run`: `elan scale add 1` starts a joiner that waits (no coordination for 1000
    steps) and SIGTERM makes it exit 0, cancelling its request; then SIGTERM to rank 0 makes it leave, and w1 finishes
    the job alone as the new rank 0."""
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    env = elan_env(tmp_path)
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "user",
               "--coordinate-every", "1000", "--state-dir", str(tmp_path / "user-state"), "--term-grace", "60",
               "--", sys.executable, str(script)]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = OutputReader(job)
        status = wait_for_status(env, "user", lambda s: s["members"] and all(m["pid"] for m in s["members"]))
        pids = pids_by_worker(status)
        output.wait_for("trained step 2")
        scale = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "scale", "--job", "user", "add", "1"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert scale.returncode == 0, scale.stderr
        wait_for_status(env, "user", lambda s: s["pending"] and s["pending"][0]["worker_status"] == {"w2": "ready"})
        joiner_pid = int(output.wait_for("spawned w2").rsplit("pid ", 1)[1].rstrip(")\n"))
        os.kill(joiner_pid, signal.SIGTERM)
        output.wait_for(f"w2 (pid {joiner_pid}) exited with code 0 (expected)")
        status = wait_for_status(env, "user", lambda s: not s["pending"])
        assert [(f["request_id"], f["outcome"]) for f in status["failures"]] == [("r1", "cancelled")]

        os.kill(pids["w0"], signal.SIGTERM)
        job.wait(timeout=600)
        text = output.text()
        (tmp_path / "user.log").write_text(text)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, text[-4000:]
    assert f"w0 (pid {pids['w0']}) exited with code 0 (expected)" in text
    assert "done: steps=480 rank=0 world=1" in text, "w1 finished every step as the new rank 0"
    adjustments = [json.loads(line) for line in (tmp_path / "user-state" / "adjustments.jsonl").read_text().split()]
    assert [(a["action"], a["leavers"], a["members"]) for a in adjustments] == [("leave", ["w0"], ["w1"])]
