"""``Accelerator(split_batches=True)`` and an evaluation after the ``epochs()`` loop (``accelerate_split_eval_loop.py``,
Accelerate's ``complete_nlp_example.py`` style), under the real `elan run`, against a plain 2-process ``Accelerator``:

* with ``split_batches=True`` the loader's ``batch_size`` is the global batch (Accelerate splits it over the
  processes): 16 steps per epoch at any world size, as the plain run; the LR schedule and the result are the plain
  run's (within 1e-9);
* a worker that left the job (rank 0 removed) and one requested after the job's last step still run the evaluation
  after the loop, alone (``gather_for_metrics`` is local there), write their record and exit 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import RunResult, elan_env, free_port

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_split_eval_loop.py")
SAMPLES, EVAL_SAMPLES, EPOCHS = 96, 37, 3
STEPS = EPOCHS * SAMPLES // 6  # split_batches: 6 samples per step whatever the world


def elan_run(tmp: Path, name: str, schedule: str | None) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp / f"{name}-state"), *(["--schedule", schedule] if schedule else []), "--",
               sys.executable, str(LOOP), str(tmp / name), "--split-batches"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def plain_run(tmp: Path) -> RunResult:
    out, port = tmp / "plain", free_port()
    base = {**elan_env(tmp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(LOOP), str(out), "--split-batches", "--plain"],
                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    return RunResult(out, tmp / "plain-state", max(proc.returncode for proc in procs), "\n".join(outputs))


def records(run: RunResult) -> dict[str, dict]:
    return {path.stem[len("record-"):]: json.loads(path.read_text()) for path in run.out.glob("record-*.json")}


def assert_like_plain(run: RunResult, plain: RunResult) -> None:
    assert run.returncode == 0, run.excerpt()
    per_epoch: dict[str, Counter] = {}
    for record in records(run).values():
        for epoch, indices in record["trained"].items():
            per_epoch.setdefault(epoch, Counter()).update(indices)
    assert per_epoch == {str(epoch): Counter(range(SAMPLES)) for epoch in range(EPOCHS)}
    expected = torch.load(plain.out / "final.pt")
    actual = torch.load(run.out / "final.pt")
    for key, value in expected.items():
        assert torch.allclose(actual[key], value, rtol=0, atol=1e-9), key
    reference = records(plain)["plain0"]
    members = [record for record in records(run).values() if not record["left"] and record["lrs"]]
    assert members and all(len(record["lrs"]) <= STEPS for record in members)
    for record in members:  # the LR of each step a member trained is the plain run's LR of that step
        assert record["lrs"] == pytest.approx(reference["lrs"][-len(record["lrs"]):], abs=1e-15)
    final = [record["final_evaluation"] for record in members]
    assert all(indices == list(range(EVAL_SAMPLES)) for indices, _ in final)
    assert all(loss == pytest.approx(reference["final_evaluation"][1], abs=1e-9) for _, loss in final)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    run = plain_run(tmp_path_factory.mktemp("plain"))
    assert run.returncode == 0, run.output[-3000:]
    assert len(records(run)["plain0"]["lrs"]) == STEPS
    return run


def test_split_batches_trains_the_plain_runs_steps(tmp_path: Path, plain: RunResult) -> None:
    static = elan_run(tmp_path, "static", None)
    assert_like_plain(static, plain)
    assert {len(record["lrs"]) for record in records(static).values()} == {STEPS}


def test_a_leaver_and_a_late_joiner_evaluate_after_the_loop_alone(tmp_path: Path, plain: RunResult) -> None:
    run = elan_run(tmp_path, "elastic", f"3:add=1,6:remove=rank:0,{STEPS + 5}:add=1")
    assert_like_plain(run, plain)
    assert "a collective failed" not in run.output, run.excerpt()
    spawned = {line.split()[2] for line in run.output.splitlines() if line.startswith("elan: spawned")}
    assert set(records(run)) == spawned == {"w0", "w1", "w2", "w3"}, run.excerpt()
    leaver = records(run)["w0"]
    assert leaver["left"] and leaver["final_evaluation"][0] == list(range(EVAL_SAMPLES))
    assert "SIGKILL" not in run.output, run.excerpt()
