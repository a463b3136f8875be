"""From the user's side: ``trainer.test(ckpt_path="best")`` after ``fit``, as Lightning's docs show, in a job whose
rank 0 left before the first checkpoint. The worker that left ends its script once its ``fit`` returned (its model
stopped training when it left): it does not test, and exits 0 like every other; the job's workers test the best
checkpoint and get the static run's result."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "test_best_after_fit.py"


def run(tmp_path: Path, name: str, schedule: str | None, *args: str, ok: bool = True) -> tuple[str, list[dict]]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp_path / f"{name}-state")]
    if schedule:
        command += ["--schedule", schedule]
    out = tmp_path / name
    command += ["--", sys.executable, str(SCRIPT), str(out), *args]
    job = subprocess.run(command, env=elan_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    if ok:
        assert job.returncode == 0, job.stdout[-4000:]
        assert "Traceback" not in job.stdout, job.stdout[-4000:]
    return job.stdout, [json.loads(path.read_text()) for path in sorted(out.glob("tested-*.json"))]


def test_a_worker_that_left_skips_the_test_of_the_best_checkpoint(tmp_path: Path) -> None:
    _, static = run(tmp_path, "static", None)
    output, elastic = run(tmp_path, "elastic", "3:remove=rank:0")
    assert "w0 (pid" in output and "exited with code 1" not in output, output[-4000:]
    assert re.search(r"w0 \(pid \d+\) exited with code 0 \(expected\)", output), output[-4000:]
    assert sorted(result["rank"] for result in elastic) == [0], "the stayer tested, the leaver's script ended at fit"
    expected = static[0]["results"][0]["test_loss"]
    tested = next(result["results"][0]["test_loss"] for result in elastic if result["rank"] == 0)
    assert abs(tested - expected) <= 1e-9, (tested, expected)


def test_a_death_during_the_test_after_fit_is_recovered(tmp_path: Path) -> None:
    """A member SIGKILLed in ``trainer.test`` after ``fit``: the survivor recovers and tests the best checkpoint again,
    alone, from its first batch; the job exits 0 with the static run's result (before: the job failed with gloo's
    "Connection reset by peer" traceback; tests/integration/test_kills_after_fit.py covers the other calls)."""
    _, static = run(tmp_path, "static", None)
    _, tested = run(tmp_path, "dies", None, "--die-testing")
    assert [result["rank"] for result in tested] == [0], tested
    expected = static[0]["results"][0]["test_loss"]
    assert abs(tested[0]["results"][0]["test_loss"] - expected) <= 1e-9, (tested, expected)
