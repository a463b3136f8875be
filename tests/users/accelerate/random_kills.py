"""Kills at moments nobody picked, on the Accelerate corpus' user scripts:
``python -m tests.users.accelerate.random_kills --dir D [--script NAME ...] [--seed S] [--seeds N]``.

``test_accelerate_corpus.py`` kills a chosen rank at a chosen step; here the moment and the victim are drawn. Per seed
one script (drawn from ``--script``, default all of ``SCRIPTS``) runs under ``elan run --nproc 2 --replace-failed``,
half the seeds with a worker joining at step 3, and one random worker process gets SIGKILL (2 in 3) or SIGTERM at a
random moment between 0.5 s after the launch and the script's static wall time (imports, ``prepare()``, a step, an
all-reduce, ``gather_for_metrics``, ``save_state``, ``save_pretrained``, the joiner's warm-up). The victim's stack is
taken first (``py-spy dump``, ``victim.txt``).

A seed *held* when the job exited 0 and: its final model (``final/model.safetensors``) equals the static run's
within 1e-9 (5e-5 for L-BFGS, see ``Script.tolerance``); every optimizer step was applied by one world (ranks
0..world-1, a signalled process's line may be missing: it can die between applying a step and logging it); no sample
was trained twice in an epoch and none is missing but the share of such an unlogged line; the members were
bit-identical at every micro-batch (the corpus' observer). A job that outlives ``TIMEOUT_S`` is hung (every process's
stack in ``stacks.txt``). One line per seed, then ``held: H of N``; exit 0 only if all held. A script's static run
is made once per ``--dir``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests import processes
from tests.integration.elastic_runs import elan_env
from tests.users.accelerate.corpus_runs import OBSERVER, TOLERANCE, assert_members_agree, assert_states_close
from tests.users.accelerate.corpus_runs import Job as CorpusJob
from tests.users.accelerate.corpus_runs import Run as CorpusRun
from tests.users.corpus import end_every_process_of, shm_dir
from tests.users.random_kills_fsdp import signal_one, stop_hung_job, where

HERE = Path(__file__).parent
TIMEOUT_S = 400.0
GROW_SCHEDULE = "3:add=1"


@dataclass(frozen=True)
class Script:
    """A corpus script and the arguments of its job (``--output_dir`` is added)."""

    file: str
    args: tuple[str, ...] = ()
    replicated: bool = True
    """Every member holds the whole state (not FSDP2): the members' digests must agree."""
    tolerance: float = TOLERANCE
    """How far the final model may be from the static run's: L-BFGS amplifies the last bits that another partition
    of the batch gives its gradients (after 24 steps a graceful resize ends 3.6e-8 from the static run; after 32, jobs
    whose second worker left or died before or in the first step, so one process trained most of it, 3.1e-6 to
    4.5e-6: seeds 4201-4203)."""


SCRIPTS = {  # more epochs than the corpus' jobs: most of a run is training, not start-up
    "bert": Script("classify_bert.py", ("--num_train_epochs", "8", "--test_after_training")),
    "gpt2": Script("causal_lm_gpt2.py", ("--num_train_epochs", "6")),
    "gpt2_fsdp": Script("causal_lm_gpt2.py", ("--num_train_epochs", "6", "--fsdp"), replicated=False),
    "cv": Script("cv_example_resume.py", ("--checkpointing_steps", "5", "--num_epochs", "10")),
    "nosync": Script("split_nosync_trigger.py"),
    "lbfgs": Script("lbfgs_regression.py", ("--num_epochs", "4"), tolerance=5e-5),
    "first": Script("prepare_main_first.py", ("--num_epochs", "6", "--prepare_seconds", "3")),
}


def launch(home: Path, name: str, schedule: str | None, shm: Path) -> subprocess.Popen:
    script = SCRIPTS[name]
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", home.name,
               "--coordinate-every", "1", "--replace-failed", "--state-dir", str(home / "state"),
               *(["--schedule", schedule] if schedule else []),
               "--", sys.executable, str(HERE / script.file), "--output_dir", str(home / "out"), *script.args]
    env = {**elan_env(home), "USERS_OBSERVE": str(home / "observe"), "ELAN_PRELOAD_SITECUSTOMIZE": "worker",
           "ELAN_SHM_DIR": str(shm)}
    env["PYTHONPATH"] = os.pathsep.join([str(OBSERVER), *filter(None, [env.get("PYTHONPATH")])])
    (home / "observe").mkdir(parents=True, exist_ok=True)
    with (home / "output.log").open("w") as log:
        return subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def workers(home: Path) -> list[int]:
    """The job's live worker processes: those ``elan run`` logged as spawned (a worker forked from the preload
    process is not its child) that still run the script with ``--output_dir HOME/out``."""
    spawned = processes.spawned_workers((home / "output.log").read_text(errors="replace"))
    return sorted(pid for pid in spawned.values() if processes.runs_script(pid, home / "out"))


def run(home: Path, name: str, schedule: str | None, moment: float | None, sig: int,
        rng: random.Random) -> tuple[int, str, float, int | None]:
    """The job to its end, ``sig`` sent to a random worker ``moment`` s after the launch. Returns the exit code, a
    note, the wall time and the victim's pid."""
    home.mkdir(parents=True, exist_ok=True)
    shm = shm_dir(home)  # the job's shared-memory segments: a killed source cannot unlink its own
    started, note, victim = time.monotonic(), "", None
    proc = launch(home, name, schedule, shm)
    try:
        if moment is not None:
            time.sleep(moment)
            pids = workers(home)
            while not pids and proc.poll() is None and time.monotonic() - started < moment + 3.0:
                time.sleep(0.05)  # the launcher spawns its members a moment after it starts
                pids = workers(home)
            victim, note = signal_one(home, pids, sig, rng, moment)
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        note += stop_hung_job(home, proc, workers(home))
    finally:
        end_every_process_of(home)
        shutil.rmtree(shm, ignore_errors=True)
    return proc.returncode, note, time.monotonic() - started, victim


def trained(home: Path) -> list[dict[str, Any]]:
    corpus_run = CorpusRun(CorpusJob(home.name, ""), home, 0, "")
    return corpus_run.trained()


def assert_steps_and_samples(home: Path, static: Path, victim: int | None) -> None:
    """Each step applied by one world, each sample once per epoch; the victim's last line may be missing."""
    lines, reference = trained(home), trained(static)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_step.setdefault(line["step"], []).append(line)
    assert sorted(by_step) == sorted({line["step"] for line in reference}), f"steps applied: {sorted(by_step)}"
    unlogged = 0
    for step, step_lines in by_step.items():
        world = step_lines[0]["world"]
        ranks = sorted(line["rank"] for line in step_lines)
        assert all(line["world"] == world for line in step_lines), f"step {step}: two worlds"
        assert len(set(ranks)) == len(ranks) and set(ranks) <= set(range(world)), f"step {step}: ranks {ranks}"
        if len(ranks) < world:
            assert victim is not None and len(ranks) == world - 1, f"step {step}: ranks {ranks} of {world}"
            unlogged += 1
    assert unlogged <= 1, f"{unlogged} steps lack a rank's line"
    assert_each_sample_once(lines, reference, allowed_missing=unlogged)


def assert_each_sample_once(lines: list[dict[str, Any]], reference: list[dict[str, Any]],
                            allowed_missing: int) -> None:
    expected: dict[int, set[int]] = {}
    for line in reference:
        expected.setdefault(line["epoch"], set()).update(line["ids"])
    seen: dict[int, Counter] = {}
    for line in lines:
        seen.setdefault(line["epoch"], Counter()).update(line["ids"])
    assert sorted(seen) == sorted(expected), f"epochs: {sorted(seen)}"
    for epoch, counts in seen.items():
        duplicated = sorted(sample for sample, count in counts.items() if count > 1)
        missing = sorted(expected[epoch] - set(counts))
        assert not duplicated, f"epoch {epoch}: trained twice {duplicated}"
        assert not missing or allowed_missing, f"epoch {epoch}: missing {missing}"


def with_tied_entries(actual: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """``actual`` with the entries it lacks that are tied weights in ``expected`` (equal to an entry both have):
    ``save_pretrained`` writes a tied weight once when the state dict shares its tensor (a world of one under
    FSDP2), twice when it holds two gathered copies."""
    filled = dict(actual)
    for key in expected.keys() - actual.keys():
        twins = [other for other in actual if other in expected and torch.equal(expected[other], expected[key])]
        if twins:
            filled[key] = actual[twins[0]]
    return filled


def verdict(home: Path, static: Path, victim: int | None, script: Script) -> str:
    try:
        expected = load_file(static / "out" / "final" / "model.safetensors")
        actual = load_file(home / "out" / "final" / "model.safetensors")
        assert_states_close(with_tied_entries(actual, expected), with_tied_entries(expected, actual),
                            atol=script.tolerance, where="final")
        assert_steps_and_samples(home, static, victim)
        assert_tested_as_static(home, static)
        if script.replicated:
            assert_members_agree(CorpusRun(CorpusJob(home.name, ""), home, 0, ""))
    except (AssertionError, FileNotFoundError) as error:
        return f"DIFF {str(error)[:300]}"
    return "held"


def assert_tested_as_static(home: Path, static: Path) -> None:
    """A script that evaluates a test split after its loop (``classify_bert.py --test_after_training``) logged the
    static run's test metrics, over every test sample, whoever died during that pass or after it."""
    def tested(root: Path) -> list[dict[str, Any]]:
        return [line for line in CorpusRun(CorpusJob(root.name, ""), root, 0, "").metrics() if "test_loss" in line]

    expected = tested(static)
    if not expected:
        return
    lines = tested(home)
    assert len(lines) == 1, f"test metrics logged {len(lines)} times"
    line = lines[0]
    assert line["test_samples"] == expected[0]["test_samples"], (line, expected[0])
    assert abs(line["test_loss"] - expected[0]["test_loss"]) <= 1e-9, (line, expected[0])


def static_run(root: Path, name: str) -> float:
    """The script's static run (made once per ``root``): its wall time."""
    home = root / f"static-{name}"
    timing = home / "wall_s.txt"
    if not timing.exists():
        shutil.rmtree(home, ignore_errors=True)
        returncode, _, wall_s, _ = run(home, name, None, None, 0, random.Random(0))
        if returncode != 0:
            raise SystemExit(f"the static run of {name} failed (exit {returncode}): {home / 'output.log'}")
        timing.write_text(f"{wall_s}")
    return float(timing.read_text())


@dataclass
class Trial:
    """One seed's run: the script, whether a worker joined, the signal's note, the victim, the outcome."""

    seed: int
    name: str
    schedule: str | None
    note: str
    wall_s: float
    victim: int | None
    outcome: str
    home: Path

    def line(self) -> str:
        grow = " +grow" if self.schedule else ""
        outcome = f"{self.wall_s:.0f} s: {self.outcome} :: {where(self.home, 3)}"
        return f"seed {self.seed} {self.name}{grow}: {self.note}, {outcome}"


def run_seed(root: Path, names: list[str], seed: int) -> Trial:
    """The trial of ``seed``: its script, signal, schedule and moment drawn from it."""
    rng = random.Random(seed)
    name = rng.choice(names)
    span_s = static_run(root, name)
    sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
    schedule = GROW_SCHEDULE if rng.random() < 0.5 else None
    home = root / f"seed{seed}-{name}"
    shutil.rmtree(home, ignore_errors=True)
    returncode, note, wall_s, victim = run(home, name, schedule, rng.uniform(0.5, span_s), sig, rng)
    static = root / f"static-{name}"
    outcome = verdict(home, static, victim, SCRIPTS[name]) if returncode == 0 else f"EXIT {returncode}"
    return Trial(seed, name, schedule, note, wall_s, victim, outcome, home)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--script", action="append", choices=sorted(SCRIPTS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="keep every seed's folder (default: failures only)")
    args = parser.parse_args(argv)
    names, held = args.script or sorted(SCRIPTS), 0
    for seed in range(args.seed, args.seed + args.seeds):
        trial = run_seed(args.dir, names, seed)
        held += trial.outcome == "held"
        print(trial.line(), flush=True)
        if trial.outcome == "held" and not args.keep:
            shutil.rmtree(trial.home, ignore_errors=True)
    print(f"held: {held} of {args.seeds}", flush=True)
    return 0 if held == args.seeds else 1


if __name__ == "__main__":
    sys.exit(main())
