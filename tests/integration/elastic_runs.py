"""Helpers of the integration tests (fixtures built on them are in ``conftest.py``): run the probe script through
`elan run`, read what it and the AM recorded, and check the invariants every elastic run must keep.

What a run is checked against never depends on timing: when a scheduled adjustment lands depends on when its joiners
report ready, so adjustments are checked for the invariants (``check_adjustment_steps``), never for a step number.
Facts are read from structured records: the probe's ``record-<worker>.json`` and ``config.json``, the AM's
``adjustments.jsonl`` (including the route each joiner reports it received over) and ``elan status --json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.procs import free_port  # noqa: F401 (the tests import it from here)

PROBE = Path(__file__).with_name("probe_train.py")

# the probe's default job: global batch 12 (6 per worker × 2), 9 steps per epoch, the epoch's last batch 4 samples
SAMPLES, EPOCHS, BATCH = 100, 3, 6
STEPS_PER_EPOCH = 9
PROBE_ARGS = ["--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]
TOLERANCE = 1e-9  # final parameters against a static run


def epoch_ends(epochs: int, steps_per_epoch: int = STEPS_PER_EPOCH) -> set[int]:
    """The global steps reached by each epoch's last batch, for epochs of a fixed number of steps."""
    return {steps_per_epoch * (epoch + 1) for epoch in range(epochs)}


@dataclass
class RunResult:
    out: Path
    state_dir: Path
    returncode: int
    output: str

    def excerpt(self) -> str:
        """The first traceback (where a failure starts) and the end of the output."""
        start = self.output.find("Traceback")
        head = self.output[start : start + 6000] if start >= 0 else ""
        return f"{head}\n...\n{self.output[-3000:]}"

    def records(self) -> list[dict]:
        return [json.loads(path.read_text()) for path in sorted(self.out.glob("record-*.json"))]

    def config(self) -> dict:
        """The ``ProbeConfig`` the job ran (``probe_train.py`` writes it before training)."""
        return json.loads((self.out / "config.json").read_text())

    def final_state(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "final.pt")

    def adjustments(self) -> list[dict]:
        """The AM's adjustment records (``adjustments.jsonl``), in completion order."""
        path = self.state_dir / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def elan_env(tmp: Path) -> dict[str, str]:
    """Each test's own ELAN_HOME; a process killed by a fatal signal (SIGABRT, SIGSEGV) prints every thread's
    Python stack, so a crash seen once in CI says where it happened."""
    return {**os.environ, "ELAN_HOME": str(tmp / "elan-home"), "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}


def elan_command(tmp: Path, name: str, nproc: int, probe_args: list[str], schedule: str | None = None,
                 coordinate_every: int = 1, launcher_args: tuple[str, ...] = ()) -> list[str]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", str(coordinate_every), "--state-dir", str(tmp / f"{name}-state"), *launcher_args]
    if schedule:
        command += ["--schedule", schedule]
    return [*command, "--", sys.executable, str(PROBE), "--out", str(tmp / name), *probe_args]


def elan_run(tmp: Path, name: str, nproc: int, probe_args: list[str], schedule: str | None = None,
             coordinate_every: int = 1, timeout: float = 300) -> RunResult:
    """Run the probe script as job ``name`` to the end; its output goes to ``tmp/name``, the AM's to ``name-state``."""
    command = elan_command(tmp, name, nproc, probe_args, schedule, coordinate_every)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


# ---------------------------------------------------------------------- the invariants of every run


def consumed_per_epoch(records: list[dict]) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for record in records:
        for epoch, indices in record["consumed"].items():
            epochs.setdefault(int(epoch), Counter()).update(indices)
    return epochs


def assert_each_sample_once(records: list[dict], num_samples: int, epochs: int) -> None:
    assert_counted_once(consumed_per_epoch(records), num_samples, epochs)


def assert_counted_once(per_epoch: dict[int, Counter], num_samples: int, epochs: int) -> None:
    """``{epoch: Counter(sample index)}`` holds every sample of every epoch exactly once."""
    assert sorted(per_epoch) == list(range(epochs)), f"epochs seen: {sorted(per_epoch)}"
    for epoch, counts in per_epoch.items():
        duplicated = sorted(index for index, count in counts.items() if count > 1)
        missing = sorted(set(range(num_samples)) - set(counts))
        assert not duplicated and not missing, f"epoch {epoch}: duplicated {duplicated}, missing {missing}"


def digests_by_step(records: list[dict]) -> dict[int, set[str]]:
    """``{step: {digest of parameters and optimizer state of every worker that trained it}}``."""
    steps: dict[int, set[str]] = {}
    for record in records:
        for step, _world, _rank, digest in record["digests"]:
            steps.setdefault(step, set()).add(digest)
    return steps


def assert_ranks_agree(records: list[dict]) -> int:
    """Every worker that trained step s held bit-identical parameters and optimizer state; returns steps checked."""
    by_step = digests_by_step(records)
    diverged = {step: len(digests) for step, digests in by_step.items() if len(digests) > 1}
    assert not diverged, f"ranks diverged at steps {sorted(diverged)}"
    return len(by_step)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        difference = (actual[key] - expected[key]).abs().max().item()
        assert difference <= atol, f"{key}: max difference {difference:.3e} > {atol:.0e}"


def check_static_run(run: RunResult) -> RunResult:
    assert run.returncode == 0, run.excerpt()
    assert_each_sample_once(run.records(), SAMPLES, EPOCHS)
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    return run


def assert_exact(run: RunResult, static: RunResult) -> list[dict]:
    """The invariants of any job of the default probe, however its membership changed: every sample once per epoch,
    bit-identical workers at every step, final parameters equal to ``static`` within ``TOLERANCE``."""
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    return records


def check_elastic_run(run: RunResult, static: RunResult, schedule: str, sizes: list[int],
                      coordinate_every: int = 1) -> list[dict]:
    """A job of the default probe (``PROBE_ARGS``) that ran ``schedule``: exit 0, each sample once per epoch,
    bit-identical workers at every step, final parameters equal to ``static`` within ``TOLERANCE``; the adjustments
    are the schedule's, in order, with world sizes ``sizes``, each where the protocol allows it
    (``check_adjustment_steps``). Returns the adjustment records."""
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    assert_every_trained_batch_ends_where_it_trained(records)
    adjustments = run.adjustments()
    assert [len(a["members"]) for a in adjustments] == sizes, adjustments
    check_adjustment_steps(adjustments, schedule, coordinate_every, epoch_ends(EPOCHS))
    for leaver in (record for record in records if record["left"]):
        assert leaver["rank"] == -1 and leaver["global_step"] < EPOCHS * STEPS_PER_EPOCH
    left = sorted(record["worker"] for record in records if record["left"])
    assert left == sorted(worker for a in adjustments for worker in a["leavers"]), "every leaver, and only they, left"
    return adjustments


def assert_every_trained_batch_ends_where_it_trained(records: list[dict]) -> None:
    """Lightning's promise, on every process: each trained batch's ``on_train_batch_end`` runs (a leaver's last batch
    too), with the rank and world size the batch trained under (not the next generation's)."""
    for record in records:
        assert record["batch_ends"] == record["trained"], f"{record['worker']}: hooks of trained batches"


def scheduled(schedule: str) -> list[tuple[int, str]]:
    """``"3:add=1,9:remove=rank:0"`` → ``[(3, "add"), (9, "remove")]``, in submission order (requests r1, r2, …)."""
    items = []
    for item in schedule.split(","):
        step, _, action = item.partition(":")
        items.append((int(step), action.partition("=")[0]))
    return items


def check_adjustment_steps(adjustments: list[dict], schedule: str | None, coordinate_every: int,
                           epoch_ends: set[int]) -> None:
    """What the protocol guarantees about *where* adjustments land (the exact step depends on when joiners report
    ready). With a ``schedule``: one adjustment per scheduled request, in request order (FIFO), with the request's
    action, each at or after its scheduled step. Always: generations 1, 2, …, each strictly after the previous one,
    at a coordination point (a multiple of ``coordinate_every``, or the batch after one that was deferred because it
    ended an epoch), and never at an epoch's last batch (the coordination after it is deferred to the next batch).
    ``epoch_ends``: the global steps reached by an epoch's last batch."""
    assert [a["generation"] for a in adjustments] == list(range(1, len(adjustments) + 1)), adjustments
    if schedule is not None:
        items = scheduled(schedule)
        assert [a["request_id"] for a in adjustments] == [f"r{i + 1}" for i in range(len(items))], adjustments
        assert [a["action"] for a in adjustments] == [action for _, action in items]
        for adjustment, (at_step, _) in zip(adjustments, items, strict=True):
            step = adjustment["step"]
            assert step >= at_step, f"{adjustment['request_id']} applied at step {step}, scheduled for {at_step}"

    def ends_epoch(step: int) -> bool:
        return step in epoch_ends

    previous = 0
    for adjustment in adjustments:
        step = adjustment["step"]
        assert step > previous, f"{adjustment['request_id']} at step {step}, not after the previous ({previous})"
        deferred = ends_epoch(step - 1) and (step - 1) % coordinate_every == 0
        assert step % coordinate_every == 0 or deferred, (
            f"step {step} is not a coordination point (every {coordinate_every}, epochs ending at {sorted(epoch_ends)})"
        )
        assert not ends_epoch(step), f"step {step} ends an epoch: the adjustment must wait a batch"
        previous = step


# ---------------------------------------------------------------------- replication routes


def received_routes(run: RunResult) -> dict[str, tuple[str, str]]:
    """``{joiner: (source, route actually used)}`` from the adjustment records (the record's ``transfers`` is the
    *plan*; ``received`` is what each joiner reports it used, e.g. ``shm-fallback``)."""
    return {
        joiner: (received["source"], received["route"])
        for record in run.adjustments()
        for joiner, received in record["received"].items()
    }


# ---------------------------------------------------------------------- a job running in the background


def elan_cli(env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def wait_for_status(env: dict, job: str, predicate: Callable[[dict], object], timeout: float = 180.0) -> dict:
    """Poll ``elan status --json`` until ``predicate(status)`` holds."""
    deadline, status, proc = time.monotonic() + timeout, None, None
    while time.monotonic() < deadline:
        proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "status", "--job", job, "--json"],
                              env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            status = json.loads(proc.stdout)
            if predicate(status):
                return status
        time.sleep(0.3)
    raise AssertionError(f"status never matched; last: {status} {proc.stderr if proc else ''}")


def read_metrics_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a CSVLogger ``metrics.csv`` (rows as ``{column: text}``; a ragged row fails)."""
    import csv

    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = [dict(zip(header, row, strict=True)) for row in reader]
    return header, rows
