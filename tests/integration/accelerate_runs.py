"""Helpers of the Accelerate integration tests: run ``accelerate_probe.py`` through `elan run` or as a plain
``Accelerator`` job, and check what every elastic Accelerate run must keep."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.integration.elastic_runs import (
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_ranks_agree,
    assert_states_close,
    consumed_per_epoch,
    elan_env,
    free_port,
)

PROBE = Path(__file__).with_name("accelerate_probe.py")
SAMPLES, BATCH, EPOCHS = 96, 6, 3  # global batch 12 at 2 workers: 8 global batches per epoch


JOB_ARGS = {
    1: ["--accumulation", "1"],
    # the second variant also shuffles (a seedable sampler in the plain run) and loads with worker processes
    2: ["--accumulation", "2", "--shuffle", "--num-workers", "2"],
}
"""The probe's options for the two reference jobs, by gradient accumulation steps."""


def loop_run(tmp: Path, name: str, loop: Path, loop_args: tuple[str, ...] = (), *, nproc: int = 2,
             schedule: str | None = None) -> RunResult:
    """``elan run --nproc N [--schedule S] -- python LOOP tmp/name ARGS`` (a user's Accelerate loop writing its
    ``record-<worker>.json`` files to ``tmp/name``), to its end; its output goes to ``tmp/name.log``."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", "1", "--state-dir", str(tmp / f"{name}-state"),
               *(["--schedule", schedule] if schedule else []), "--", sys.executable, str(loop), str(tmp / name),
               *loop_args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def loop_records(run: RunResult) -> dict[str, dict]:
    """Each worker's ``record-<worker>.json``, by worker id."""
    return {path.stem[len("record-"):]: json.loads(path.read_text()) for path in run.out.glob("record-*.json")}


def total_steps(accumulation: int) -> int:
    """Optimizer steps of the default job (launched with 2 workers)."""
    return EPOCHS * SAMPLES // (BATCH * 2 * accumulation)


def accelerate_run(tmp: Path, name: str, nproc: int, args: list[str], schedule: str | None = None,
                   timeout: float = 300, coordinate_every: int = 1, secret_file: Path | None = None,
                   env: dict[str, str] | None = None) -> RunResult:
    """The probe as job ``name`` through `elan run` (output in ``tmp/name``, the AM's state in ``name-state``)."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", str(coordinate_every), "--state-dir", str(tmp / f"{name}-state")]
    if schedule:
        command += ["--schedule", schedule]
    if secret_file is not None:
        command += ["--secret-file", str(secret_file)]
    command += ["--", sys.executable, str(PROBE), "--out", str(tmp / name), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**elan_env(tmp), **(env or {})})
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def plain_accelerate_run(tmp: Path, name: str, nproc: int, args: list[str]) -> RunResult:
    """The probe with a plain ``Accelerator``, its processes started the way torchrun starts them."""
    out, port = tmp / name, free_port()
    base = {**elan_env(tmp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    procs = [
        subprocess.Popen([sys.executable, str(PROBE), "--out", str(out), "--plain", *args],
                         env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(nproc)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    failed = max(proc.returncode for proc in procs)
    return RunResult(out, tmp / f"{name}-state", failed, "\n".join(outputs))


def check_accelerate_run(run: RunResult, reference: RunResult, sizes: list[int], accumulation: int = 1) -> list[dict]:
    """Exit 0, each sample once per epoch, every member bit-identical at every step, final state equal to the
    reference within 1e-9, the adjustments' world sizes; every leaver (and only they) left with rank -1."""
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_counted_once(consumed_per_epoch(records), SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == total_steps(accumulation)
    assert_states_close(run.final_state(), reference.final_state(), TOLERANCE)
    for record in records:  # gather() returned one value per process of the world the step trained in
        assert all(world == gathered for _s, _e, world, _g, _lr, gathered in record["steps"]), record["worker"]
    adjustments = run.adjustments()
    assert [len(a["members"]) for a in adjustments] == sizes, adjustments
    left = sorted(record["worker"] for record in records if record["left"])
    assert left == sorted(worker for a in adjustments for worker in a["leavers"])
    assert all(record["rank"] == -1 for record in records if record["left"])
    return adjustments


def committed_batches(run: RunResult) -> dict[int, Counter]:
    """``{epoch: Counter(sample index)}`` over the batches that count: for every place in an epoch (the position a
    global batch was cut at), the attempt of the latest generation — a batch whose step was discarded when a member
    died is cut again from the same position by the next generation (``batches-<worker>.jsonl``, flushed per batch)."""
    attempts: dict[tuple[int, int], list[tuple[int, list[int]]]] = {}
    for path in run.out.glob("batches-*.jsonl"):
        for line in map(json.loads, path.read_text().splitlines()):
            attempts.setdefault((line["epoch"], line["position"]), []).append((line["generation"], line["indices"]))
    per_epoch: dict[int, Counter] = {}
    for (epoch, _position), tries in attempts.items():
        latest = max(generation for generation, _ in tries)
        for generation, indices in tries:
            if generation == latest:
                per_epoch.setdefault(epoch, Counter()).update(indices)
    return per_epoch
