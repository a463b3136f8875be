"""The Slurm recipe (``deploy/slurm/``) on a real one-node Slurm cluster started by the test (slurmctld + slurmd +
munge): ``sbatch --ntasks=2 elan-job.sbatch`` starts the AM and two `elan worker`s through ``srun``; a second
``sbatch elan-grow.sbatch`` adds a worker that joins the running job; ``scancel`` of that second job makes its worker
leave gracefully (Slurm's SIGTERM, delivered to every process of the step). The job ends equal to the static run
within 1e-9, every sample once per epoch, and both Slurm jobs complete with exit code 0."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import PROBE, PROBE_ARGS, RunResult, assert_exact, elan_env, free_port
from tests.integration.slurm_cluster import SlurmCluster, require_slurm

pytestmark = [pytest.mark.integration, pytest.mark.solo]  # its joiner must join within 120 s: alone under -n

RECIPES = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
JOB = "slurmjob"


@pytest.fixture
def slurm(tmp_path: Path):
    require_slurm()
    with SlurmCluster(tmp_path / "slurm") as cluster:
        yield cluster


def adjustments(state_dir: Path) -> list[dict]:
    path = state_dir / "adjustments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(predicate, timeout_s: float, what: str, diagnostics) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s\n{diagnostics()}"
        time.sleep(0.3)


def test_slurm_recipe_grows_by_a_second_sbatch_and_shrinks_by_scancel(slurm, static_run, tmp_path):
    am_port, secret, out = free_port(), tmp_path / "secret", tmp_path / "out"
    env = {**elan_env(tmp_path), "ELAN_AM_HOST": "127.0.0.1", "ELAN_AM_PORT": str(am_port),
           "ELAN_RDZV_PORT": str(free_port()), "ELAN_SECRET_FILE": str(secret), "MAX_WORKERS": "3"}
    train = ["--", sys.executable, str(PROBE), "--out", str(out), *PROBE_ARGS, "--step-sleep", "1.0"]
    state_dir = Path(env["ELAN_HOME"]) / "jobs" / JOB

    def diagnostics() -> str:
        outputs = "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
                            for path in sorted(tmp_path.glob("slurm-*.out")))
        return f"{outputs}\n{slurm.logs()}"

    first = slurm.sbatch(RECIPES / "elan-job.sbatch", JOB, *train, options=("--ntasks=2",), env=env, cwd=tmp_path)
    wait_until(lambda: list(out.glob("completed-*")), 120, "training step of the first two workers", diagnostics)
    grow = slurm.sbatch(RECIPES / "elan-grow.sbatch", f"127.0.0.1:{am_port}", JOB, *train, env=env, cwd=tmp_path)
    wait_until(lambda: [a for a in adjustments(state_dir) if a["action"] == "add"], 120, "join", diagnostics)
    slurm.scancel(grow)

    first_job = slurm.wait_finished(first, 180)
    grow_job = slurm.wait_finished(grow, 60)
    log = diagnostics()
    assert (first_job["JobState"], first_job["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert grow_job["JobState"] == "CANCELLED", log
    assert "elan-grow: the workers exited with code 0" in log, log
    assert [(a["action"], len(a["members"])) for a in adjustments(state_dir)] == [("add", 3), ("leave", 2)], log
    assert not any("failure" in a for a in adjustments(state_dir)), "the scancelled worker left, it did not crash"
    assert secret.stat().st_mode & 0o077 == 0, "the secret the recipe created is private"
    assert_exact(RunResult(out, state_dir, 0, ""), static_run)
