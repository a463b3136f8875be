"""A job that sizes itself, through real `elan run` jobs of the probe script (a plain Lightning script).

* ``--stragglers replace``: the probe's worker w1 sleeps 3× as long per step as the others (``--slow-worker``, keyed
  on its own worker id, like a user's script on a slow GPU); the AM flags it from the members' compute times, adds a
  replacement, and removes w1 once the replacement has joined. Exactly once and equal to the static run.
* ``elan profile --min 1 --max 3`` on a running 3-worker job: three throughputs recorded, the job back at 3, a
  ThroughputModel JSON written; exact.
* ``--autoscale throughput`` on a workload whose step takes ``C/k + B·k`` seconds (it stops scaling): the autoscaler
  grows from 1 while the scaling efficiency stays above S and settles at the size where it falls below; exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    PROBE_ARGS,
    RunResult,
    assert_exact,
    elan_command,
    elan_env,
)

pytestmark = pytest.mark.integration


def measures_throughput(test: Callable[..., None]) -> Callable[..., None]:
    """A measurement: alone under ``pytest -n`` (the argument checks share the cores), outside the CI tier."""
    return pytest.mark.extended(pytest.mark.solo(test))


GLOBAL = ["--global-batch", "12"]  # the static run's 2 × 6, split over however many workers there are


def run_job(tmp: Path, name: str, nproc: int, probe_args: list[str], launcher_args: tuple[str, ...],
            timeout: float = 300) -> RunResult:
    command = elan_command(tmp, name, nproc, probe_args, launcher_args=launcher_args)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


@measures_throughput
def test_a_3x_slower_worker_is_replaced_and_the_run_stays_exact(static_run, tmp_path):
    probe = [*PROBE_ARGS, *GLOBAL, "--step-sleep", "0.25", "--slow-worker", "w1:0.5"]
    run = run_job(tmp_path, "straggler", 2, probe, ("--stragglers", "replace", "--straggler-window", "3"))
    assert run.returncode == 0, run.excerpt()
    adjustments = run.adjustments()
    causes = [(a["action"], (a.get("cause") or {}).get("kind"), (a.get("cause") or {}).get("decision"))
              for a in adjustments]
    assert causes[:2] == [("add", "straggler", "replace"), ("leave", "straggler", "remove")], adjustments
    assert adjustments[1]["leavers"] == ["w1"], adjustments
    assert adjustments[0]["cause"]["inputs"]["straggler"] == "w1"
    assert adjustments[0]["cause"]["inputs"]["score"] < 0.8
    assert "w1" not in adjustments[-1]["members"] and len(adjustments[-1]["members"]) == 2
    assert_exact(run, static_run)


def elan_cli(tmp: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_elan.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=elan_env(tmp))


def wait_for_step(tmp: Path, job: str, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = elan_cli(tmp, "status", "--job", job, "--json", timeout=30)
        if status.returncode == 0 and (json.loads(status.stdout).get("step") or 0) >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not reach step {step} within {timeout_s} s")


@measures_throughput
def test_elan_profile_1_to_3_records_three_throughputs_and_the_job_ends_exact(tmp_path):
    probe = [*PROBE_ARGS, *GLOBAL, "--epochs", "8"]
    static = run_job(tmp_path, "static8", 2, probe, ())
    assert static.returncode == 0, static.excerpt()
    command = elan_command(tmp_path, "profiled", 3, [*probe, "--step-sleep", "0.25"])
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=elan_env(tmp_path))
    try:
        wait_for_step(tmp_path, "profiled", 2)
        profile = elan_cli(tmp_path, "profile", "--job", "profiled", "--min", "1", "--max", "3", "--steps", "6")
        output, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert profile.returncode == 0, profile.stdout + profile.stderr + output
    assert job.returncode == 0, output
    run = RunResult(tmp_path / "profiled", tmp_path / "profiled-state", 0, output)
    sizes = [len(a["members"]) for a in run.adjustments()]
    assert sizes == [2, 1, 3], run.adjustments()
    assert all(a["cause"]["kind"] == "profile" for a in run.adjustments())
    rates = {int(size): rate for size, rate in json.loads(
        (tmp_path / "profiled-state" / "state.json").read_text())["state"]["sizing"]["profile_result"]["rates"].items()}
    assert sorted(rates) == [1, 2, 3] and all(rate > 0 for rate in rates.values()), rates
    for size in (1, 2, 3):
        assert f"{size:>7}" in profile.stdout, profile.stdout
    model = json.loads((tmp_path / "profiled-state" / "profile.json").read_text())
    from lightning_elan.scaling.throughput import ThroughputModel

    assert ThroughputModel.from_state_dict(model).ready()
    assert_exact_epochs(run, static, 8)


def assert_exact_epochs(run: RunResult, static: RunResult, epochs: int) -> None:
    from tests.integration.elastic_runs import (
        SAMPLES,
        STEPS_PER_EPOCH,
        TOLERANCE,
        assert_each_sample_once,
        assert_ranks_agree,
        assert_states_close,
    )

    records = run.records()
    assert_each_sample_once(records, SAMPLES, epochs)
    assert assert_ranks_agree(records) == epochs * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)


@measures_throughput
def test_throughput_autoscaler_settles_where_scaling_efficiency_falls_below_the_threshold(tmp_path):
    probe = [*PROBE_ARGS, *GLOBAL, "--epochs", "10"]
    static = run_job(tmp_path, "static10", 2, probe, ())
    assert static.returncode == 0, static.excerpt()
    # a step takes 0.6/k + 0.1·k s: R1 ∝ 1/0.7, R2 ∝ 1/0.5, R3 ∝ 1/0.5: s(1→2) = 0.4 > 0.1, s(2→3) = 0 < 0.1
    run = run_job(tmp_path, "autoscaled", 1, [*probe, "--sleep-model", "0.6,0.1"],
                  ("--autoscale", "throughput", "--autoscale-every", "4", "--autoscale-threshold", "0.1",
                   "--autoscale-max", "4"))
    assert run.returncode == 0, run.excerpt()
    adjustments = run.adjustments()
    assert [len(a["members"]) for a in adjustments] == [2, 3, 2], adjustments
    assert all(a["cause"]["kind"] == "autoscale" for a in adjustments)
    state = json.loads((tmp_path / "autoscaled-state" / "state.json").read_text())["state"]
    decisions = [d for d in state["sizing"]["decisions"] if d["kind"] == "autoscale"]
    assert decisions[-1]["decision"] == "hold", decisions
    assert_exact_epochs(run, static, 10)


@measures_throughput
def test_utility_autoscaler_adds_a_worker_only_while_finishing_sooner_is_worth_its_price(static_run, tmp_path):
    """The first decision adds a worker on the linear estimate (at linear speed-up the job costs the same
    worker-seconds and finishes sooner). Once 2 workers are measured (sub-linear: R2 ≈ 1.5 R1): a free worker
    (price 0) still pays and stays; at 1000 per worker-second the worker-seconds it wastes outweigh the utility and the
    job goes back to 1. The samples left come from the script's own loop (Lightning's ``max_epochs``), sent with rank
    0's coordinate."""
    utility = tmp_path / "utility.json"
    utility.write_text(json.dumps({"points": [[0, 100], [60, 0]]}))  # every second sooner is worth 5/3
    probe = [*PROBE_ARGS, *GLOBAL, "--sleep-model", "0.4,0.05"]
    options = ("--autoscale", "utility", "--utility", str(utility), "--autoscale-every", "3", "--autoscale-max", "2")
    free = run_job(tmp_path, "free", 1, probe, (*options, "--price", "0"))
    dear = run_job(tmp_path, "dear", 1, probe, (*options, "--price", "1000"))
    for run in (free, dear):
        assert run.returncode == 0, run.excerpt()
        assert_exact(run, static_run)
    assert [len(a["members"]) for a in free.adjustments()] == [2], free.adjustments()
    assert free.adjustments()[0]["cause"]["kind"] == "autoscale"
    assert free.adjustments()[0]["cause"]["inputs"]["remaining_samples"] > 0
    assert [len(a["members"]) for a in dear.adjustments()] == [2, 1], dear.adjustments()
    back = dear.adjustments()[1]["cause"]["inputs"]
    assert back["estimated"] == [] and back["rates"]["2"] > back["rates"]["1"], back  # measured, faster, too dear


@pytest.mark.parametrize(("args", "message"), [
    (["profile", "--job", "nosuchjob", "--min", "1", "--max", "2"], "no running job named nosuchjob"),
    (["profile", "--job", "j", "--min", "3", "--max", "2"], "--min 3 is more than --max 2"),
    (["profile", "--job", "j", "--min", "0", "--max", "2"], "must be an integer in 1.."),
    (["autoscale", "--job", "j", "--policy", "magic"], "invalid choice: 'magic'"),
    (["run", "--nproc", "1", "--job", "j", "--autoscale-every", "3", "--", "true"], "need --autoscale POLICY"),
    (["run", "--nproc", "1", "--job", "j", "--stragglers", "sometimes", "--", "true"], "invalid choice"),
    (["run", "--nproc", "1", "--job", "j", "--autoscale", "utility", "--", "true"], "needs --price P and --utility"),
    (["run", "--nproc", "1", "--job", "j", "--autoscale", "throughput", "--autoscale-min", "3", "--autoscale-max", "2",
      "--", "true"], "--autoscale-min 3 is more than --autoscale-max 2"),
    (["run", "--nproc", "1", "--job", "j", "--straggler-threshold", "1.5", "--", "true"], "a number in [0, 1)"),
])
def test_bad_sizing_arguments_are_refused_with_a_clear_message(tmp_path, args, message):
    result = elan_cli(tmp_path, *args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_garbage_utility_file_is_refused_naming_the_file(tmp_path):
    utility = tmp_path / "utility.json"
    utility.write_bytes(b"\x00\xffnot json")
    result = elan_cli(tmp_path, "autoscale", "--job", "j", "--policy", "utility", "--price", "1", "--utility",
                      str(utility), timeout=60)
    assert result.returncode == 2 and str(utility) in result.stderr and "Traceback" not in result.stderr, result.stderr


@measures_throughput
def test_a_job_of_elan_workers_grows_through_the_scale_out_command(static_run, tmp_path):
    """`elan am --min-workers 1 --autoscale throughput --scale-out-command CMD` and one `elan worker`: the autoscaler
    wants 2 workers, the AM runs CMD (here: start another `elan worker` of the job, as `sbatch worker.sh` would), the
    new worker enrols and joins by itself; the job ends exact."""
    from tests.integration.elastic_runs import PROBE, free_port

    address = f"127.0.0.1:{free_port()}"
    probe = [sys.executable, str(PROBE), "--out", str(tmp_path / "out"), *PROBE_ARGS, *GLOBAL,
             "--sleep-model", "0.4,0.05"]
    worker = [sys.executable, "-m", "lightning_elan.cli", "worker", "--am", address, "--job", "grown", "--", *probe]
    command = " ".join(worker) + f" > {tmp_path / 'scaled-out.log'} 2>&1"
    env = elan_env(tmp_path)
    am = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", "am", "--job", "grown", "--bind",
                           f"tcp://{address}", "--state-dir", str(tmp_path / "state"), "--min-workers", "1",
                           "--max-workers", "2", "--start-grace", "0", "--coordinate-every", "1",
                           "--autoscale", "throughput", "--autoscale-every", "3", "--autoscale-max", "2",
                           "--scale-out-command", command],
                          env=env, stdout=(tmp_path / "am.log").open("w"), stderr=subprocess.STDOUT)
    first = subprocess.Popen(worker, env=env, stdout=(tmp_path / "w.log").open("w"), stderr=subprocess.STDOUT)
    try:
        assert first.wait(240) == 0, (tmp_path / "w.log").read_text()
        assert am.wait(60) == 0, (tmp_path / "am.log").read_text()
    finally:
        for proc in (first, am):
            proc.kill()
    run = RunResult(tmp_path / "out", tmp_path / "state", 0, (tmp_path / "am.log").read_text())
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 2)], adjustments
    assert "asking for a worker" in (tmp_path / "am.log").read_text()
    assert_exact(run, static_run)
