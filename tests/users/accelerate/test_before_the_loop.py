"""An ordinary Accelerate script whose main process prepares the data while the others wait in
``wait_for_everyone()``, and whose processes meet once more after ``prepare()`` (``regress_prepared_on_main.py``),
under the real ``elan run``: a member SIGKILLed while the main process is still preparing, and a worker that joins
the running job (its ``wait_for_everyone()`` after ``prepare()`` is one the members made long ago). Each run must
end 0, train every sample once per epoch and end where the static run of the same launch ends (float64, 1e-9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests import processes
from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_adjustments,
    assert_each_sample_once,
    assert_members_agree,
    assert_ok,
    assert_states_close,
    assert_steps_applied_once,
    elan_command,
    job_env,
    run_job,
)

pytestmark = pytest.mark.integration

SCRIPT = "regress_prepared_on_main.py"
SAMPLES, EPOCHS, BATCH = 96, 2, 4
PREPARATION_S = 8.0  # the main process's data preparation: the kill lands inside it


def _steps(world: int) -> range:
    return range(EPOCHS * SAMPLES // (BATCH * world))


def _epoch_gathers(run: Run) -> list[tuple[int, int]]:
    """(epoch, how many processes its closing ``gather`` saw), from the main process's ``epochs.jsonl``."""
    lines = (run.out / "epochs.jsonl").read_text().splitlines()
    return [(line["epoch"], line["processes"]) for line in map(json.loads, lines)]


def _final(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run.out / "final.pt")


def _assert_exact(run: Run, static: Run, launch_world: int) -> None:
    assert_ok(run)
    assert_each_sample_once(run.trained(), SAMPLES, EPOCHS)
    assert_steps_applied_once(run.trained(), _steps(launch_world))
    assert_members_agree(run)
    assert_states_close(_final(run), _final(static), where="final model")


@pytest.fixture(scope="module")
def static_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """The static runs the elastic ones must equal: 2 and 3 workers from the start to the end."""
    runs = {}
    for world in (2, 3):
        run = run_job(tmp_path_factory.mktemp(f"static{world}"), Job(f"static{world}", SCRIPT, nproc=world))
        assert_ok(run)
        assert_steps_applied_once(run.trained(), _steps(world))
        assert _epoch_gathers(run) == [(0, world), (1, world)]
        runs[world] = run
    return runs


def test_a_member_killed_while_the_main_process_prepares_the_data(static_runs: dict[int, Run],
                                                                   tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed while rank 0 still makes the data and rank 1 waits for it in ``wait_for_everyone()``: the
    barrier does not let rank 1 through before the data is there; the two survivors train the job exactly."""
    job = Job("prepare_kill", SCRIPT, ("--preparation_seconds", str(PREPARATION_S)), nproc=3)
    (tmp_path / "observe").mkdir()
    env = job_env(tmp_path, job)
    log = tmp_path / "output.log"
    with open(log, "w") as output:
        proc = subprocess.Popen(elan_command(tmp_path, job), cwd=tmp_path, env=env, stdout=output,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        victim = _rank_2_once_the_data_is_being_prepared(log, tmp_path / "out")
        os.kill(victim["pid"], signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = Run(job, tmp_path, proc.returncode, log.read_text())
    _assert_exact(run, static_runs[3], 3)
    assert [(r["action"], r["failure"]["dead"]) for r in run.adjustments()] == [("failure", [victim["worker_id"]])]
    assert _epoch_gathers(run) == [(0, 2), (1, 2)]


def _rank_2_once_the_data_is_being_prepared(launcher_log: Path, out: Path) -> dict:
    """The worker launched as rank 2 (``w2``: its id and pid, from the launcher's log), once the main process has
    started preparing the data (and not finished)."""
    deadline = time.monotonic() + 120
    while not (out / "preparing").exists():
        assert time.monotonic() < deadline, "the main process never started preparing the data"
        time.sleep(0.02)
    assert not (out / "data.pt").exists(), "the data was ready before the kill"
    pid = processes.spawned_workers(launcher_log.read_text())["w2"]
    assert processes.runs_script(pid, SCRIPT), pid
    return {"worker_id": "w2", "pid": pid}


@pytest.mark.parametrize("step", [3, 12], ids=["mid-epoch", "after-the-epochs-last-batch"])
def test_a_joiners_code_before_its_first_batch_meets_nobody(static_runs: dict[int, Run], tmp_path: Path,
                                                            step: int) -> None:
    """A worker added at step 3 (mid-epoch 0), or at step 12 (after epoch 0's last batch), runs the code the members
    ran before the batches it joins at — ``wait_for_everyone()`` after ``prepare()`` and at the epoch's start — on its
    own (the members made those collectives before they trained), and the epoch's closing ``gather`` with them."""
    job = Job("joiner_barrier", SCRIPT, ("--step_seconds", "0.05"), nproc=2, schedule=f"{step}:add=1")
    run = run_job(tmp_path, job)
    _assert_exact(run, static_runs[2], 2)
    assert_adjustments(run, [("add", 3)])
    assert _epoch_gathers(run) == [(0, 3), (1, 3)], "the epochs' closing gather saw every process"
