"""The worker-fault harness: run the probe through `elan run` while a worker is SIGKILLed at a chosen point, and check
the job as the faults issue demands (exit 0, every sample once per epoch, survivors bit-identical, the final parameters
of the static run, the failure recorded with its timings).

A worker is killed with a real SIGKILL, sent by itself at a named phase: the probe's ``--kill-at WORKER:STEP:PHASE``
(``backward``: in the backward pass, while the others wait in the gradient all-reduce; ``optimizer``: after every
member committed the step), or, for the phases inside the library (a replication source while it sends, a joiner while
it receives), a test-only ``sitecustomize`` on the victim's ``PYTHONPATH`` (``fault_kill/``, driven by
``ELAN_TEST_KILL=WORKER:PHASE``). Samples are counted from the probe's ``completed-<worker>.jsonl``: a batch is logged
when its step was applied, so a killed worker keeps what it completed and a discarded batch is not counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.faults.checks import assert_each_sample_once
from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    SAMPLES,
    TOLERANCE,
    RunResult,
    assert_ranks_agree,
    assert_states_close,
    elan_env,
)

FAULT_KILL_DIR = Path(__file__).with_name("fault_kill")
UNBLOCK_LIMIT_S = 10.0  # the issue's bound on the time from a death to the survivors' recovery plan


def fault_command(tmp: Path, name: str, nproc: int, probe_args: list[str], *, schedule: str | None = None,
                  launcher_args: tuple[str, ...] = (), library_kill: str | None = None,
                  coordinate_every: int = 1) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``elan run`` of the probe (global batch 12 whatever ``nproc``, as the static
    run) with a fault."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", str(coordinate_every), "--state-dir", str(tmp / f"{name}-state"), *launcher_args]
    if schedule:
        command += ["--schedule", schedule]
    command += ["--", sys.executable, str(PROBE), "--out", str(tmp / name), *PROBE_ARGS, "--global-batch", "12",
                *probe_args]
    env = elan_env(tmp)
    if library_kill:
        env = {**env, "ELAN_TEST_KILL": library_kill,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_KILL_DIR), env.get("PYTHONPATH")])),
               "ELAN_PRELOAD_SITECUSTOMIZE": "worker"}
    return command, env


def fault_run(tmp: Path, name: str, nproc: int, probe_args: list[str], *, schedule: str | None = None,
              launcher_args: tuple[str, ...] = (), library_kill: str | None = None, timeout: float = 300) -> RunResult:
    """``elan run`` of the probe with a fault (:func:`fault_command`), to its end."""
    command, env = fault_command(tmp, name, nproc, probe_args, schedule=schedule, launcher_args=launcher_args,
                                 library_kill=library_kill)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def completed_per_epoch(out: Path) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for path in sorted(out.glob("completed-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            epochs.setdefault(entry["epoch"], Counter()).update(entry["indices"])
    return epochs


def assert_completed_once(out: Path) -> None:
    """Each sample once per epoch in the completed logs; with ``--progress`` a killed worker's batch whose step stood
    before it logged the batch counts too (``tests/faults/checks.py``: a kill at a moment no hold point picked)."""
    assert_each_sample_once(out, SAMPLES, EPOCHS)


def failure_records(run: RunResult) -> list[dict]:
    return [record for record in run.adjustments() if record["action"] == "failure"]


def check_fault_run(run: RunResult, static: RunResult, dead: list[str], sharded: bool = False) -> list[dict]:
    """The job survived the deaths of ``dead``; returns the failure records (one per recovery). ``sharded``
    (``elan_fsdp``): the members hold different shards, so only the full state gathered at the end is compared."""
    assert run.returncode == 0, run.excerpt()
    assert_completed_once(run.out)
    if not sharded:
        assert_ranks_agree(run.records())
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    survivors = {record["worker"] for record in run.records()}
    assert not survivors & set(dead), f"{sorted(survivors & set(dead))} wrote a record: they were not killed"
    failures = failure_records(run)
    assert sorted(w for f in failures for w in f["failure"]["dead"]) == sorted(dead), failures
    for failure in failures:
        unblocked = failure["failure"]["recovered_at"] - failure["failure"]["detected_at"]
        assert unblocked < UNBLOCK_LIMIT_S, f"survivors unblocked after {unblocked:.1f} s"
    for record in run.records():  # a batch discarded by the failure was trained again: its hooks ran for the redo
        assert_discarded_batches_were_redone(record)
        assert_epoch_counts_are_the_trained_batches(record)
    return failures


def assert_discarded_batches_were_redone(record: dict) -> None:
    """Every batch whose training step ran has its ``on_train_batch_end``, except a batch discarded by a failure,
    which is trained again (with the next generation's rank and world) and whose hook then runs. With gradient
    accumulation the whole window of the interrupted step is redone: its earlier batches had ended, and end again."""
    ended = Counter(tuple(batch[:2]) for batch in record["batch_ends"])
    trained = Counter(tuple(batch[:2]) for batch in record["trained"])
    assert set(ended) == set(trained), f"{record['worker']}: trained {sorted(set(trained) - set(ended))} never ended"
    if record["config"].get("accumulate", 1) == 1:
        assert all(count == 1 for count in ended.values()), f"{record['worker']}: a batch ended twice"
    else:
        assert all(ended[batch] <= trained[batch] for batch in ended), f"{record['worker']}: a batch ended twice"


def assert_epoch_counts_are_the_trained_batches(record: dict) -> None:
    """What a process accumulated over an epoch (a torchmetrics ``SumMetric`` and ``self.log(reduce_fx="sum",
    on_epoch=True)`` of its batches' sample counts) is the samples of the batches it trained and ended that epoch: a
    discarded step's first attempt does not count. Accumulation: a redone window's batches end again, the last
    time counts."""
    sizes = {(epoch, batch_idx): samples for epoch, batch_idx, samples in record["ended_samples"]}
    for epoch, counts in record["epoch_counts"].items():
        trained = sum(size for (e, _), size in sizes.items() if e == int(epoch))
        for kind, count in counts.items():
            assert count == trained, f"{record['worker']} epoch {epoch}: {kind} {count}, its batches {trained}"


def unblock_seconds(failures: list[dict]) -> list[float]:
    return [f["failure"]["recovered_at"] - f["failure"]["detected_at"] for f in failures]
