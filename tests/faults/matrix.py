"""The fault matrix: ``python -m tests.faults.matrix --trials N``.

A cell is a phase of the training at which a member is SIGKILLed (a real signal, sent from outside once every member
holds at that phase: ``tests/integration/hold_point.py``), a victim (``w1``, rank 0 ``w0``, or ``w1+w2``: a second
member killed 0.1-1 s after the first, while the survivor recovers) and a front-end (Lightning; Lightning's sharded
``elan_fsdp``, the model one unit or each Linear its own (``fsdp``, ``fsdp_units``), checked against a static
``elan_fsdp`` run on the full state the members gather at the end; Accelerate with gradient accumulation 1 and 2). Each
trial (seeded by ``--seed``, its number and its cell) jitters the step it holds at and how long the members stay held
before the kill. The Lightning front-end has cells for kills inside the library too (the worker SIGKILLs itself there:
``tests/integration/fault_kill/``): at a coordination point, with an adjustment agreed, as a replication source, as a
joiner receiving its state and as a joiner still warming up. A trial *held* when the job exited 0, every sample counted
once per epoch, the survivors stayed bit-identical at every step, the final parameters (and optimizer state) equal the
static run within 1e-9, the failure was recovered for exactly the dead, and the step redone is the one the phase
implies. Under a sharded front-end a trial whose two victims were a shard's holder and the holder of its mirror (the
second killed before the recovery from the first mirrored its shard again) holds when the job fails with ``ShardsLost``
naming the two: the documented outcome. ``--jobs K`` runs K trials at once. Prints one line per trial and a table phase
x victim: held/trials; exit 0 only if every trial held."""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import traceback
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests import processes
from tests.integration.accelerate_runs import EPOCHS as ACC_EPOCHS
from tests.integration.accelerate_runs import JOB_ARGS, committed_batches, plain_accelerate_run, total_steps
from tests.integration.accelerate_runs import SAMPLES as ACC_SAMPLES
from tests.integration.elastic_runs import (
    PROBE_ARGS,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_ranks_agree,
    assert_states_close,
    check_static_run,
    elan_env,
    elan_run,
)
from tests.integration.held_faults import held_accelerate_run, held_lightning_run
from tests.integration.hold_point import METRIC, PHASES
from tests.integration.worker_faults import check_fault_run, fault_run

COMMITTED = ("optimizer", "batch_end")
"""Phases after every member committed the step: it stands, the next one is the first redone."""
AFTER_STEP = ("validation", "checkpoint", "epoch_end")
"""Phases that follow step STEP (its hold step counts the steps done): the next step is the first redone."""
VICTIMS = ("w1", "w0", "w1+w2", "source", "joiner")
LIBRARY_CELLS = (("coordination", "w1"), ("coordination", "w0"), ("adjusting", "w1"), ("adjusting", "w0"),
                 ("replication", "source"), ("receiving", "joiner"), ("warming", "joiner"))
"""Kills inside the library (the worker SIGKILLs itself: ``tests/integration/fault_kill/``) around an adjustment: at
the coordination point, with the AM's plan agreed (``adjusting``), a replication source sending, a joiner receiving
and a joiner still warming up (its receive buffer prefaulting, before it reported ready)."""
LIBRARY_KILLS = {"coordination": "coordinate", "adjusting": "adjusting", "replication": "send",
                 "receiving": "receive", "warming": "warming"}
JOINER = "w3"  # the first worker the launcher starts after the 3 it launched with
SHARDED_FRONTS = {"fsdp": "elan_fsdp", "fsdp_units": "elan_fsdp_units"}
"""Sharded Lightning front-ends and the probe's strategy: the model one FSDP2 unit, or each Linear its own."""


@dataclass(frozen=True)
class Cell:
    front: str  # "lightning", "fsdp", "fsdp_units", "accelerate1", "accelerate2"
    phase: str
    victim: str

    @property
    def name(self) -> str:
        return f"{self.front}:{self.phase}:{self.victim}"


def expected_redone(phase: str, step: int) -> int:
    """The step (counted from 1) a recovery redoes: the held one, the next once it was committed or done."""
    if phase in AFTER_STEP:
        return step + 1
    return step + (2 if phase in COMMITTED else 1)


def lightning_cells() -> list[Cell]:
    phases = ["data", METRIC, *PHASES, "validation", "checkpoint", "epoch_end"]
    return ([Cell("lightning", phase, victim) for phase in phases for victim in VICTIMS[:3]]
            + [Cell("lightning", phase, victim) for phase, victim in LIBRARY_CELLS])


def fsdp_cells() -> list[Cell]:
    """``elan_fsdp``: a step's phases (its forward inside the root unit's call, the reduce-scatter, the vote...)."""
    return [Cell(front, phase, victim) for front in SHARDED_FRONTS for phase in (METRIC, *PHASES)
            for victim in VICTIMS[:3]]


def accelerate_cells() -> list[Cell]:
    return [Cell(f"accelerate{accumulation}", phase, victim)
            for accumulation in (1, 2) for phase in PHASES for victim in ("w1", "w0")]


def lightning_hold_step(phase: str, rng: random.Random) -> int:
    """A jittered step to hold at: validation follows an epoch's last step, ModelCheckpoint saves every 4 steps."""
    if phase in ("validation", "epoch_end"):
        return rng.choice([STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH])
    if phase == "checkpoint":
        return rng.choice([4, 8, 12])
    return rng.randint(2, 2 * STEPS_PER_EPOCH - 2)


SECOND_KILL_ARGS = ("--progress", "--step-sleep", "0.1")
"""A second victim is killed at no hold point (0.1-1 s after the first): the steps left take longer than that (9+
steps of 0.1 s; the job once ended before the kill on a quiet box), and its batch is counted if its step stood before
it logged the batch (``--progress``: CI saw 4 samples of such a batch missing from the completed logs)."""


def lightning_probe_args(phase: str, victim: str = "w1") -> tuple[str, ...]:
    extra = {"data": ("--num-workers", "2"), "validation": ("--val",), "checkpoint": ("--full-lightning",)}
    second = SECOND_KILL_ARGS if "+" in victim else ()
    return ("--wait-for-joiners", *extra.get(phase, ()), *second)


def kill_options(victim: str, rng: random.Random) -> tuple[str, dict]:
    first, *also = victim.split("+")
    return first, {"settle_s": rng.uniform(0.1, 1.0), "also": tuple(also), "also_after_s": rng.uniform(0.1, 1.0)}


def run_lightning(cell: Cell, tmp: Path, static: RunResult, rng: random.Random) -> str:
    step = lightning_hold_step(cell.phase, rng)
    first, options = kill_options(cell.victim, rng)
    sharded = cell.front in SHARDED_FRONTS
    strategy = ("--strategy", SHARDED_FRONTS[cell.front]) if sharded else ()
    probe_args = (*lightning_probe_args(cell.phase, cell.victim), *strategy)
    run, kill = held_lightning_run(tmp, "held", 3, f"{first}:{step}:{cell.phase}", members=3,
                                   launcher_args=("--replace-failed",), probe_args=probe_args, **options)
    assert kill.killed_at is not None, f"the members never all held (arrived: {kill.arrived})\n{run.excerpt()}"
    if sharded and run.returncode != 0 and len(kill.dead) > 1:
        return f"step {step}: {lost_with_its_mirror(run.output, kill.dead)}"
    failures = check_fault_run(run, static, dead=kill.dead, sharded=sharded)
    assert failures[0]["failure"]["step_redone"] == expected_redone(cell.phase, step), failures
    return f"step {step}, settle {options['settle_s']:.2f} s"


def lost_with_its_mirror(output: str, dead: list[str]) -> str:
    """A sharded job whose two victims were a shard's holder and its mirror's (the second killed before the recovery
    from the first had mirrored its shard again) fails with ``ShardsLost`` naming them: the contract's clear failure.
    Any other failure of such a job is a defect."""
    named = re.search(r"died with their mirrors: shard \d+ \(worker (\w+)\) and its mirror \(worker (\w+)\)", output)
    assert named is not None, f"a sharded job with two victims failed without ShardsLost:\n{output[-4000:]}"
    assert set(named.groups()) <= set(dead), f"ShardsLost names {named.groups()}, the dead are {dead}"
    return f"ShardsLost: shard of {named.group(1)} and its mirror on {named.group(2)}, both killed (as documented)"


def run_library(cell: Cell, tmp: Path, static: RunResult, rng: random.Random) -> str:
    """A 3-worker job (``--replace-failed``) that adds a worker after a jittered step; the victim kills itself at the
    cell's point in the library (``coordination``: at the jittered step itself, no adjustment due)."""
    step = rng.randint(2, 2 * STEPS_PER_EPOCH - 2)
    target = {"source": "*", "joiner": JOINER}.get(cell.victim, cell.victim)
    kill = f"{target}:{LIBRARY_KILLS[cell.phase]}" + (f":{step}" if cell.phase == "coordination" else "")
    schedule = None if cell.phase == "coordination" else f"{step}:add=1"
    run = fault_run(tmp, "library", 3, ["--wait-for-joiners"], schedule=schedule, launcher_args=("--replace-failed",),
                    library_kill=kill)
    log = tmp / "elan-home" / "fault-kills.log"
    assert log.exists(), f"nobody was killed at {kill}\n{run.excerpt()}"
    dead = log.read_text().split()[:1]
    failures = check_fault_run(run, static, dead=[] if cell.phase == "warming" else dead)
    if failures:  # the add is requested at ``step`` and planned once its joiner is ready: a later step
        redone = failures[0]["failure"]["step_redone"]
        assert redone == step + 1 if cell.phase == "coordination" else redone > step, failures
    return f"step {step}, {dead[0]} killed" + (f", step {redone} redone" if failures else "")


def run_accelerate(cell: Cell, tmp: Path, plain: dict[int, RunResult], rng: random.Random) -> str:
    accumulation = int(cell.front.removeprefix("accelerate"))
    step = rng.randint(3, 5)  # after the join at step 1
    first, options = kill_options(cell.victim, rng)
    args = [*JOB_ARGS[accumulation], "--wait-for-joiners"]
    run, kill = held_accelerate_run(tmp, f"held{accumulation}", 2, f"{first}:{step}:{cell.phase}", members=3,
                                    args=args, schedule="1:add=1", **options)
    assert kill.killed_at is not None, f"the members never all held (arrived: {kill.arrived})\n{run.excerpt()}"
    assert run.returncode == 0, run.excerpt()
    assert_counted_once(committed_batches(run), ACC_SAMPLES, ACC_EPOCHS)
    assert assert_ranks_agree(run.records()) == total_steps(accumulation)
    assert_states_close(run.final_state(), plain[accumulation].final_state(), TOLERANCE)
    failure = next(a for a in run.adjustments() if a["action"] == "failure")
    assert failure["failure"]["dead"] == kill.dead, failure
    assert failure["failure"]["step_redone"] == expected_redone(cell.phase, step), failure
    assert not {record["worker"] for record in run.records()} & set(kill.dead), "the dead left a record"
    return f"step {step}, settle {options['settle_s']:.2f} s"


def references(root: Path, fronts: set[str]) -> tuple[dict[str, RunResult], dict[int, RunResult]]:
    """The static runs the trials are compared with: by Lightning front-end, and Accelerate's by accumulation."""
    for folder in ("static", "plain"):
        (root / folder).mkdir(exist_ok=True)
    static = {}
    if "lightning" in fronts:
        static["lightning"] = check_static_run(elan_run(root / "static", "static", 2, PROBE_ARGS))
    for front in fronts & SHARDED_FRONTS.keys():
        sharded = elan_run(root / "static", f"static-{front}", 2, [*PROBE_ARGS, "--strategy", SHARDED_FRONTS[front]])
        assert sharded.returncode == 0, sharded.excerpt()
        static[front] = sharded
    plain = {accumulation: plain_accelerate_run(root / "plain", f"plain{accumulation}", 2, args)
             for accumulation, args in JOB_ARGS.items() if f"accelerate{accumulation}" in fronts}
    return static, plain


def trial(cell: Cell, tmp: Path, static: dict[str, RunResult], plain: dict[int, RunResult],
          rng: random.Random) -> tuple[bool, str]:
    run: Callable[[], str]
    if cell.front == "lightning" and cell.phase in LIBRARY_KILLS:
        def run() -> str:
            return run_library(cell, tmp, static["lightning"], rng)
    elif cell.front in static:
        def run() -> str:
            return run_lightning(cell, tmp, static[cell.front], rng)
    else:
        def run() -> str:
            return run_accelerate(cell, tmp, plain, rng)
    try:
        held, detail = True, run()
    except Exception as error:  # an assertion of the checks, or the harness failing: the trial did not hold
        lines = "".join(traceback.format_exception_only(error)).strip().splitlines()
        held, detail = False, " | ".join(lines[:1] + lines[-6:])
    strays = processes.wait_gone(processes.mentioning(elan_env(tmp)["ELAN_HOME"]), 15.0)
    if strays:  # a process of the job outlived it (e.g. a killed worker's DataLoader workers)
        processes.kill(strays)
        return False, f"{detail}; left behind: {', '.join(processes.command_line(pid)[:80] for pid in strays)}"
    return held, detail


def table(results: dict[Cell, list[bool]]) -> str:
    """phase x victim, per front-end: held/trials."""
    lines = []
    for front in sorted({cell.front for cell in results}):
        cells = {cell: held for cell, held in results.items() if cell.front == front}
        victims = [v for v in VICTIMS if any(cell.victim == v for cell in cells)]
        lines.append(f"{front:<14}" + "".join(f"{v:>8}" for v in victims))
        for phase in dict.fromkeys(cell.phase for cell in cells):
            row = [cells.get(Cell(front, phase, v)) for v in victims]
            lines.append(f"  {phase:<12}" + "".join(f"{sum(r)}/{len(r)}".rjust(8) if r else " " * 8 for r in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="trials per cell")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--first-trial", type=int, default=0,
                        help="number the trials from this one (their seeds follow): runs of one commit add up")
    parser.add_argument("--front", action="append",
                        choices=["lightning", *SHARDED_FRONTS, "accelerate1", "accelerate2"],
                        help="only these front-ends (default: all)")
    parser.add_argument("--phase", action="append", help="only these phases (default: all)")
    parser.add_argument("--victim", action="append", choices=VICTIMS, help="only these victims (default: all)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the trials' files here (default: a temp dir)")
    parser.add_argument("--jobs", type=int, default=1, help="trials run at once (each is a job of 3-4 processes)")
    args = parser.parse_args(argv)
    cells = [cell for cell in lightning_cells() + fsdp_cells() + accelerate_cells()
             if (not args.front or cell.front in args.front) and (not args.phase or cell.phase in args.phase)
             and (not args.victim or cell.victim in args.victim)]
    if not cells:
        parser.error("no cell matches the --front/--phase/--victim given")
    root = Path(tempfile.mkdtemp(prefix="elan-matrix-")) if args.dir is None else args.dir
    root.mkdir(parents=True, exist_ok=True)
    print(f"{len(cells)} cells x {args.trials} trials, files in {root}", flush=True)
    static, plain = references(root, {cell.front for cell in cells})
    results: dict[Cell, list[bool]] = defaultdict(list)

    def run_trial(number: int, cell: Cell) -> None:
        tmp = root / f"{cell.name.replace(':', '-').replace('+', '_')}-{number}"
        held, detail = trial(cell, tmp, static, plain, random.Random(f"{args.seed}:{number}:{cell.name}"))
        results[cell].append(held)
        print(f"{cell.name:<32} trial {number}: {'held' if held else 'FAILED'} ({detail})", flush=True)

    trial_numbers = range(args.first_trial, args.first_trial + args.trials)
    with ThreadPoolExecutor(args.jobs) as pool:  # each trial is its own job: its own ELAN_HOME, AM and ports
        for done in [pool.submit(run_trial, number, cell) for number in trial_numbers
                      for cell in cells]:
            done.result()
    print(table(results))
    held = sum(sum(r) for r in results.values())
    total = sum(len(r) for r in results.values())
    print(f"held: {held} of {total} trials")
    return 0 if held == total else 1


if __name__ == "__main__":
    sys.exit(main())
