"""The corpus harness: run a user script of ``scripts/`` through the real ``elan run`` (static, or with the elastic
schedule and a SIGKILLed worker), read what it and the AM left behind, and compare runs.

What the harness sees of a worker comes from ``observer/sitecustomize.py`` (on the jobs' ``PYTHONPATH``, never
imported by the scripts): ``observe-<pid>.jsonl`` (batch starts with a digest of the state, trained samples, the
final state of rank 0) and ``kills.log``. What the user sees comes from the script's own outputs under ``out/``.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests import processes
from tests.integration.elastic_runs import elan_env

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
OBSERVER = HERE / "observer"

SCHEDULE = "3:add=1,6:remove=rank:0,9:migrate=1"
"""Every elastic run: 2 workers grow to 3, rank 0 leaves (2), one worker migrates (2); then ``KILL_STEP``."""
KILL_STEP = 12
"""The process that is rank 1 in the training batch that starts at ``KILL_STEP`` is SIGKILLed (2 → 1 worker)."""
ADJUSTMENTS = [("add", 3), ("remove", 2), ("migrate", 2), ("failure", 1)]
"""The AM's records of every elastic run: (action, world size after it), in order."""
TOLERANCE = 1e-9
FIT_OFFSET = 1000
"""The observer's records of a process's n-th fit count steps and epochs from ``n * FIT_OFFSET`` (its FIT_OFFSET)."""
RUN_TIMEOUT_S = 400.0
STALL_S = 90.0
"""A job none of whose files changed for this long is hung: it is killed (the observer writes at every batch, and a
rank 0 holding for joiners touches a file every half second)."""


def shifted(schedule: str, offset: int) -> str:
    """``SCHEDULE`` for a job whose global step starts at ``offset`` (a resumed one)."""
    items = [item.partition(":") for item in schedule.split(",")]
    return ",".join(f"{int(step) + offset}:{action}" for step, _, action in items)


@dataclass(frozen=True)
class Job:
    """One ``elan run`` of a user command (``{out}`` and ``{scripts}`` in ``command`` are filled in), with the
    elastic ``schedule`` and the worker to ``kill`` (``STEP[:PHASE]``), if any."""

    name: str
    command: tuple[str, ...]
    nproc: int = 2
    schedule: str | None = None
    kill: str | None = None  # STEP[:PHASE], see observer/sitecustomize.py

    def argv(self, out: Path) -> list[str]:
        return [part.format(out=out, scripts=SCRIPTS) for part in self.command]


@dataclass
class Run:
    job: Job
    home: Path
    returncode: int
    output: str
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.home / "out"

    @property
    def observed(self) -> Path:
        return self.home / "observe"

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    def excerpt(self) -> str:
        """The first traceback and the end of the output (for assertion messages)."""
        start = self.output.find("Traceback")
        head = self.output[start : start + 5000] if start >= 0 else ""
        return f"{head}\n...\n{self.output[-3000:]}"

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record["event"] == kind]

    def samples_per_epoch(self) -> dict[int, Counter]:
        epochs: dict[int, Counter] = {}
        for record in self.events("trained"):
            epochs.setdefault(record["epoch"], Counter()).update(record["samples"])
        return epochs

    def digests_by_step(self) -> dict[int, set[str]]:
        steps: dict[int, set[str]] = {}
        for record in self.events("start"):
            steps.setdefault(record["step"], set()).add(record["digest"])
        return steps

    def final_state(self) -> dict[str, torch.Tensor]:
        finals = self.events("final")
        last_fit = max((final.get("fit", 1) for final in finals), default=1)  # a script that trains in stages
        finals = [final for final in finals if final.get("fit", 1) == last_fit]
        assert len(finals) == 1, f"one final state (rank 0 at the end of its last fit), got {finals}"
        return torch.load(finals[0]["path"])

    def adjustments(self) -> list[dict[str, Any]]:
        path = self.state_dir / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def kills(self) -> list[dict[str, Any]]:
        path = self.observed / "kills.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_env(home: Path, job: Job, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**elan_env(home), **(extra or {})}
    env["USERS_OBSERVE"] = str(home / "observe")
    env["PYTHONPATH"] = os.pathsep.join([str(OBSERVER), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["ELAN_PRELOAD_SITECUSTOMIZE"] = "worker"  # it may run in each worker after the fork
    if job.schedule:
        env["USERS_HOLD"] = "1"
    if job.kill is not None:
        env["USERS_KILL"] = job.kill
    return env


def elan_command(home: Path, job: Job) -> list[str]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(job.nproc), "--job", job.name,
               "--coordinate-every", "1", "--state-dir", str(home / "state")]
    if job.schedule:
        command += ["--schedule", job.schedule]
    return [*command, "--", sys.executable, *job.argv(home / "out")]


def run_job(home: Path, job: Job, env: dict[str, str] | None = None,
            during: Callable[[subprocess.Popen], None] | None = None) -> Run:
    """Run ``job`` to its end in ``home`` (its working directory; the script's outputs go to ``home/out``, what
    ``elan run`` prints to ``home/output.log``), with ``env`` added to its environment; ``during(launcher)``, if
    given, runs in a thread of its own while the job runs (it must return once the launcher has exited). A job that
    outlives ``RUN_TIMEOUT_S`` or stalls for ``STALL_S`` has the stacks of all its processes written to
    ``home/stacks.txt`` and is killed, with everything it started (one session)."""
    (home / "observe").mkdir(parents=True, exist_ok=True)
    log = home / "output.log"
    shm = shm_dir(home)  # the job's shared-memory segments: a killed source cannot unlink its own
    environment = job_env(home, job, {**(env or {}), "ELAN_SHM_DIR": str(shm)})
    with log.open("a") as output:  # appending: the launcher, the AM and the workers share it
        proc = subprocess.Popen(elan_command(home, job), cwd=home, env=environment, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        watcher = threading.Thread(target=during, args=(proc,), daemon=True) if during else None
        if watcher is not None:
            watcher.start()
        try:
            verdict = wait_for_job(proc, home)
            if verdict:
                dump_stacks(home, proc.pid)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if watcher is not None:
                watcher.join()
            end_every_process_of(home)
            shutil.rmtree(shm, ignore_errors=True)
        if verdict:
            output.write(f"\n[harness] {verdict}: killed\n")
    return read_run(home, job, proc.returncode)


def read_run(home: Path, job: Job, returncode: int) -> Run:
    """What a finished job in ``home`` left: its output and the observer's records (a process killed while it wrote
    its last record leaves a torn last line, which is skipped)."""
    records = []
    for path in sorted((home / "observe").glob("observe-*.jsonl")):
        text = path.read_text()
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            lines = lines[:-1]
        records += [json.loads(line) for line in lines]
    return Run(job, home, returncode, (home / "output.log").read_text(), records)


def dump_stacks(home: Path, launcher: int) -> None:
    """``py-spy dump`` of every process of the job (the launcher's descendants, and any process naming ``home``),
    into ``home/stacks.txt``: what a hung job was waiting for."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    pids = sorted({launcher} | processes.descendants(launcher) | processes.mentioning(f"{home}{os.sep}"))
    with (home / "stacks.txt").open("a") as stacks:
        for pid in pids:
            stacks.write(f"===== pid {pid}: {processes.command_line(pid)}\n")
            stacks.flush()
            try:
                subprocess.run([py_spy, "dump", "--pid", str(pid)], stdout=stacks, stderr=subprocess.STDOUT,
                               timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired) as error:
                stacks.write(f"py-spy: {error}\n")


def end_every_process_of(home: Path, grace_s: float = 15.0) -> None:
    """Wait for the job's processes (the AM, workers, their loader workers: all have ``home`` in their environment)
    to end after their launcher; SIGKILL those still there after ``grace_s``."""
    left = processes.wait_gone(processes.mentioning(f"{home}{os.sep}"), grace_s)
    processes.kill(left)
    processes.wait_gone(left, grace_s)


def shm_dir(home: Path) -> Path:
    """A directory of the job's own in ``/dev/shm`` (a tmpfs, as the library's default), else in ``home``."""
    if os.access("/dev/shm", os.W_OK):
        return Path(tempfile.mkdtemp(prefix="elan-users-", dir="/dev/shm"))
    (home / "shm").mkdir()
    return home / "shm"


def wait_for_job(proc: subprocess.Popen, home: Path) -> str | None:
    """Wait for ``proc``; None when it ended by itself, else why it has to be killed."""
    started = time.monotonic()
    while True:
        try:
            proc.wait(timeout=2.0)
            return None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - started > RUN_TIMEOUT_S:
            return f"still running after {RUN_TIMEOUT_S:.0f} s"
        if now - started > STALL_S and time.time() - last_change(home) > STALL_S:
            return f"hung: no file of the job changed for {STALL_S:.0f} s"


def last_change(home: Path) -> float:
    """The latest modification time of any file under ``home`` (its output, the observer's, the script's)."""
    return max((path.stat().st_mtime for path in home.rglob("*") if path.is_file()), default=0.0)


# ---------------------------------------------------------------------- what every run must keep


class KnownBug(Exception):
    """Raised where a run shows the symptom of a library bug the corpus found (README.md): the tests that meet one
    are ``xfail(strict=True, raises=KnownBug)``, so any other failure still fails them, and a fix makes them XPASS."""


def known_symptom(run: Run, symptom: str) -> None:
    """Raise :class:`KnownBug` if ``symptom`` appears in what the job printed."""
    if symptom in run.output:
        raise KnownBug(f"{run.job.name}: {symptom!r} in its output")



def assert_ok(run: Run) -> None:
    assert run.returncode == 0, f"{run.job.name} exited with {run.returncode}:\n{run.excerpt()}"


def assert_each_sample_once(run: Run, per_epoch: dict[int, int]) -> None:
    """``per_epoch``: {epoch: number of samples it trains}; each is trained exactly once."""
    seen = run.samples_per_epoch()
    assert sorted(seen) == sorted(per_epoch), f"epochs trained: {sorted(seen)}"
    for epoch, counts in seen.items():
        duplicated = sorted(sample for sample, count in counts.items() if count > 1)
        assert not duplicated, f"epoch {epoch}: samples trained more than once: {duplicated}"
        assert sum(counts.values()) == per_epoch[epoch], f"epoch {epoch}: {sum(counts.values())} samples"


def assert_same_samples(run: Run, static: Run, victims: frozenset[str] = frozenset()) -> None:
    """Every epoch trained exactly the static run's samples, each once; with the shares ``victims`` (killed or frozen
    workers) trained but never recorded (:func:`unrecorded_shares`)."""
    seen, expected = run.samples_per_epoch(), static.samples_per_epoch()
    for epoch, share in unrecorded_shares(run, static, set(victims)).items():
        seen.setdefault(epoch, Counter()).update(share)
    assert sorted(seen) == sorted(expected), f"epochs trained: {sorted(seen)}, static: {sorted(expected)}"
    for epoch in expected:
        duplicated = sorted(sample for sample, count in seen[epoch].items() if count > 1)
        missing = sorted(set(expected[epoch]) - set(seen[epoch]), key=str)
        extra = sorted(set(seen[epoch]) - set(expected[epoch]), key=str)
        assert not (duplicated or missing or extra), (
            f"epoch {epoch}: duplicated {duplicated}, missing {missing}, not in the static run {extra}"
        )


def unrecorded_shares(run: Run, static: Run, victims: set[str]) -> dict[int, Counter]:
    """The samples of victims killed after their last step stood (every member voted to commit it, so the survivors
    applied the update that holds their gradients) and before they wrote its ``trained`` record: the static run's
    samples of that batch less those recorded at the step after it. A victim that recorded its share, or a batch
    redone after the death (recorded whole by the survivors in their new world), adds nothing. The survivors' records
    may name the new world and its ranks: a recovery in the batch's ``on_train_batch_end`` hooks, before the
    observer's, comes before they record the batch trained in the old one."""
    batches: dict[tuple[int, int], list[dict]] = {}  # each batch once: two victims may have stopped in the same one
    stride = steps_per_batch(static)
    for victim in victims:
        starts = [record for record in run.events("start") if record.get("worker") == victim]
        if not starts:
            continue
        last = max(starts, key=lambda record: record["at"])
        after = [record for record in run.events("trained") if record["step"] == last["step"] + stride]
        if after:
            batches[(after[0]["epoch"], after[0]["batch_idx"])] = after
    shares: dict[int, Counter] = {}
    for (epoch, batch), after in batches.items():
        whole = Counter(sample for record in static.events("trained") if (record["epoch"], record["batch_idx"]) == (
            epoch, batch) for sample in record["samples"])
        recorded = Counter(sample for record in after if record["batch_idx"] == batch for sample in record["samples"])
        shares.setdefault(epoch, Counter()).update(whole - recorded)
    return shares


def steps_per_batch(static: Run) -> int:
    """How far ``global_step`` moves per trained batch: 1, or one per optimizer under manual optimization (the GAN's
    two), where the record of the batch after a victim's last start is not at its step + 1 (seed 702 of
    ``gan_manual``: a victim's unrecorded share was taken for missing samples)."""
    steps = sorted({record["step"] for record in static.events("start")})
    return min((later - earlier for earlier, later in itertools.pairwise(steps)), default=1)


def last_attempts(run: Run) -> dict[int, Counter]:
    """Each epoch's trained samples, counting a batch redone after a death once: of the records of one
    (epoch, batch_idx), those of its last attempt (the latest world that trained it). A micro-batch of an accumulation
    window is recorded before the window's optimizer step, so a window cut by a death is recorded twice."""
    by_batch: dict[tuple[int, int], list[dict]] = {}
    for record in run.events("trained"):
        by_batch.setdefault((record["epoch"], record["batch_idx"]), []).append(record)
    epochs: dict[int, Counter] = {}
    for (epoch, _), records in by_batch.items():
        last = max(records, key=lambda record: record["at"])
        for record in records:
            if record["world"] == last["world"]:
                epochs.setdefault(epoch, Counter()).update(record["samples"])
    return epochs


def assert_members_agree(run: Run) -> list[int]:
    """At the start of every training step all members held bit-identical parameters, buffers and optimizer
    states. Returns the steps seen."""
    by_step = run.digests_by_step()
    diverged = sorted(step for step, digests in by_step.items() if len(digests) > 1)
    assert not diverged, f"members diverged at steps {diverged}; at step {diverged[0]}:\n{_starts_at(run, diverged[0])}"
    return sorted(by_step)


def _starts_at(run: Run, step: int) -> str:
    """Each member's hyperparameters and schedulers' states at ``step``'s start (which one differs)."""
    return "\n".join(f"  {record.get('worker')}: hyper {record.get('hyper')}, schedulers {record.get('schedulers')}"
                     for record in run.events("start") if record["step"] == step)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        atol: float = TOLERANCE) -> None:
    assert actual.keys() == expected.keys(), f"{sorted(actual.keys() ^ expected.keys())}"
    for key, value in expected.items():
        difference = (actual[key].double() - value.double()).abs().max().item()
        assert difference <= atol, f"{key}: max difference {difference:.3e} > {atol:.0e}"


def assert_states_finite(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same entries and shapes as ``expected``, every value finite (what holds when the maths differs)."""
    assert actual.keys() == expected.keys(), f"{sorted(actual.keys() ^ expected.keys())}"
    for key, value in actual.items():
        assert value.shape == expected[key].shape, f"{key}: {value.shape} != {expected[key].shape}"
        if value.is_floating_point():
            assert torch.isfinite(value).all(), f"{key} is not finite"


def assert_static(run: Run, per_epoch: dict[int, int], steps: list[int]) -> None:
    """A static run: exit 0, each sample once per epoch, members identical at each of ``steps``."""
    assert_ok(run)
    assert_each_sample_once(run, per_epoch)
    assert assert_members_agree(run) == steps
    assert not run.adjustments(), "a static run has no adjustment"


def assert_elastic(run: Run, static: Run, exact: bool) -> None:
    """The elastic run of a script against its static run: exit 0 (leavers included), the schedule's adjustments
    and the failure of the killed worker, the static run's samples once per epoch, members bit-identical at every
    step, and the final state (parameters, buffers, optimizer states) equal to the static run's within
    ``TOLERANCE`` (``exact``) or whole and finite."""
    assert_ok(run)
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == ADJUSTMENTS, adjustments
    kills = run.kills()
    assert len(kills) == 1, kills
    assert adjustments[-1]["failure"]["dead"] == [kills[0]["worker"]]
    assert_same_samples(run, static)
    assert assert_members_agree(run) == sorted(static.digests_by_step())
    if exact:
        assert_states_close(run.final_state(), static.final_state())
    else:
        assert_states_finite(run.final_state(), static.final_state())


# ---------------------------------------------------------------------- the users' own outputs


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a CSVLogger ``metrics.csv`` (a ragged row fails)."""
    with path.open(newline="") as file:
        reader = csv.reader(file)
        header = next(reader)
        rows = [dict(zip(header, row, strict=True)) for row in reader]
    return header, rows


def logged(rows: list[dict[str, str]], column: str) -> dict[int, float]:
    """``{step: value}`` of one metric; a step logged twice fails."""
    values: dict[int, float] = {}
    for row in rows:
        if row.get(column):
            step, value = int(row["step"]), float(row[column])
            if step in values:
                raise AssertionError(f"{column} logged twice at step {step}")
            values[step] = value
    return values


def assert_logged_alike(run_rows: list[dict[str, str]], static_rows: list[dict[str, str]], column: str,
                        exact: bool) -> None:
    """``column`` is logged at the static run's steps; with ``exact``, with its values (within ``TOLERANCE``)."""
    actual, expected = logged(run_rows, column), logged(static_rows, column)
    assert sorted(actual) == sorted(expected), f"{column} logged at {sorted(actual)}, static {sorted(expected)}"
    for step, value in actual.items():
        assert math.isfinite(value), f"{column} at step {step}: {value}"
        if exact:
            assert abs(value - expected[step]) <= TOLERANCE, f"{column} at step {step}: {value} != {expected[step]}"


def checkpoints(directory: Path) -> dict[str, dict[str, Any]]:
    """Every ``.ckpt`` under ``directory`` by name, loaded (a torn file fails here)."""
    return {path.name: torch.load(path, weights_only=False) for path in sorted(directory.glob("*.ckpt"))}


def assert_checkpoints_alike(run_dir: Path, static_dir: Path, exact: bool) -> dict[str, dict[str, Any]]:
    """The same checkpoint files as the static run, each loadable, at the same step and epoch; with ``exact``, the
    same model and optimizer states. Returns the run's checkpoints."""
    actual, expected = checkpoints(run_dir), checkpoints(static_dir)
    assert sorted(actual) == sorted(expected), f"checkpoints {sorted(actual)}, static {sorted(expected)}"
    for name, checkpoint in actual.items():
        reference = expected[name]
        for key in ("global_step", "epoch"):
            assert checkpoint[key] == reference[key], f"{name}: {key} {checkpoint[key]} != {reference[key]}"
        if exact:
            assert_states_close(checkpoint["state_dict"], reference["state_dict"])
            for mine, theirs in zip(checkpoint["optimizer_states"], reference["optimizer_states"], strict=True):
                assert_states_close(flat_optimizer_state(mine), flat_optimizer_state(theirs))
        else:
            assert_states_finite(checkpoint["state_dict"], reference["state_dict"])
    return actual


def flat_optimizer_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {}
    for slot, values in state["state"].items():
        for key, value in values.items():
            flat[f"{slot}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return flat


def static_runs_by_world(tmp_path_factory: Any, job_of: Callable[[str, int], Job]) -> Callable[[int], Run]:
    """``static(nproc)``: the static run of ``job_of(name, nproc)`` with ``nproc`` processes, run when first needed
    (for a module-scoped fixture), checked to exit 0."""
    runs: dict[int, Run] = {}

    def static(nproc: int) -> Run:
        if nproc not in runs:
            run = run_job(tmp_path_factory.mktemp(f"static{nproc}"), job_of(f"static{nproc}", nproc))
            assert_ok(run)
            runs[nproc] = run
        return runs[nproc]

    return static
