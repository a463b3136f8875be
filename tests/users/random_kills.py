"""Kills at moments nobody picked, on the corpus' user scripts:
``python -m tests.users.random_kills --script NAME --seed S [--seeds N] [--signal KILL|TERM|MIXED] [--dir D]``.

The corpus (``test_corpus.py``) kills at a chosen step and phase; here the moment is drawn. One *trial* runs a corpus
script under ``elan run --nproc 2`` (half the seeds with ``--schedule 3:add=1``, a worker joining at step 3) and, at
seeded random wall-clock moments between the launcher's start and the static run's wall time (start-up, sanity check,
training, validation, checkpoint saving, epoch end, evaluation after ``fit``, teardown), sends SIGKILL or SIGTERM to a
random worker process (the real OS process, ``os.kill``; a SIGTERM to its DataLoader processes too): once, or twice when
a worker joins. The victim is stopped (SIGSTOP) for the moment its stack is taken (``py-spy dump``,
``victim-<pid>.txt``: where it was hit), then signalled. A kill never takes the job's last member that holds the
training state (nothing could go on: not a case to test).

A trial *held* when what the corpus checks holds: the job exited 0 (SIGTERM is a graceful leave, SIGKILL a recovered
failure), no worker but a signalled one was declared dead, no worker hit by SIGTERM alone was (it left), each epoch
trained the static run's samples exactly once, the members were bit-identical at every step and ran the static run's
steps, the final state equals the static run's within 1e-9 (exact scripts) or is whole and finite, and the script's own
outputs (logs, checkpoints, predictions) pass the corpus' checks against the static run. A job with no progress for 90 s
is a hang: every process's stack is in ``stacks.txt`` (``corpus.run_job``). Prints one line per trial and ``held: H of
N``; exit 0 only if all held. Each script's static run is made once per ``--dir`` and reused."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from tests import processes
from tests.integration.elastic_runs import elan_env
from tests.users.corpus import (
    SCRIPTS,
    TOLERANCE,
    Job,
    Run,
    assert_members_agree,
    assert_ok,
    assert_states_close,
    assert_states_finite,
    last_attempts,
    read_run,
    run_job,
    unrecorded_shares,
)
from tests.users.test_corpus import (
    CORPUS,
    OUTPUT_CHECKS,
    assert_fit_bounds_alike,
    fit_bounds_summary,
    write_wikitext,
)

GROW_SCHEDULE = "3:add=1"
GROW_SCHEDULES: dict[str, str | None] = {"boring_demo": None}
"""A script's own grow (None: never grows): ``boring_demo`` validates 64 samples, which 3 processes do not share
evenly (``DistributedSampler`` pads them with repeated samples, under DDP too): its validation loss at 3 workers is not
the static run's."""
SPAN_FACTOR = 1.1
"""Kill moments are drawn in [0, SPAN_FACTOR × span] after the launcher starts; the span is the static run's wall
time, then the longest trial's so far (a loaded machine runs the job longer)."""
ACCUMULATING = {"accumulate_by_epoch", "validate_mid_accumulation"}
"""Scripts whose micro-batches are recorded before their window's step: a window cut by a death is recorded twice."""
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}
FREEZE = {"STOP": signal.SIGSTOP}
"""``--signal STOP``: the victim stays stopped (a frozen process: a paused host, a hang outside any collective); for a
script with a short collective timeout (``short_timeout.py``), as the others wait for the frozen one that long."""
AFTER_TRAINING = "after the training was complete (another member finished it)"
"""``elan run``'s warning for a worker that died after another member's ``fit`` returned: elan recovers from a death
during ``fit`` only (README), so what the dead worker's script does after ``fit`` (its share of a ``predict``) is lost,
and the job exits 0 with that warning. The script's outputs after ``fit`` are not checked then."""
LATER_FIT = "is past the job's elastic fit"
"""A survivor's error for a death in a later ``fit`` of the script (``fit_again_hparams.py`` fits twice): only a
process's first training ``fit`` is elastic (README), so the job fails with that message; such a trial is labelled,
not counted as a failure."""
FINISHING = "the job is finished or shutting down"
"""The SIGTERM watch's reason for the crash path when there is no job left to leave (``elastic/termination.py``)."""
SIGHT_S = 30.0
"""A shot due before the AM answers or a worker runs waits this long for them."""


@dataclass(frozen=True)
class Plan:
    """What a seed decides: the schedule, the moments (seconds after the launcher's start, or after the first training
    batch that starts at ``anchor_step`` or later: a fixed plan's phase whatever the machine's load), the signal of
    each, and a draw in [0, 1) per moment that picks the victim among the workers eligible then."""

    seed: int
    schedule: str | None
    moments: tuple[float, ...]
    signals: tuple[str, ...]
    draws: tuple[float, ...]
    anchor_step: int | None = None


def plan_for(seed: int, span_s: float, signal_name: str, schedule: str | None = GROW_SCHEDULE) -> Plan:
    rng = random.Random(seed)
    grow = rng.random() < 0.5 and schedule is not None
    count = 2 if grow and rng.random() < 0.5 else 1
    moments = tuple(sorted(round(rng.uniform(0.0, span_s), 2) for _ in range(count)))
    signals = tuple(rng.choice(sorted(SIGNALS)) if signal_name == "MIXED" else signal_name for _ in range(count))
    return Plan(seed, schedule if grow else None, moments, signals, tuple(rng.random() for _ in range(count)))


def training_span(static: Run) -> float:
    """Seconds from the static run's first training batch start to its last trained batch (``--in-training``: the
    moments are drawn there, counted from the first batch, instead of over the whole job, whose start-up and exit
    take most of its wall time on a small machine)."""
    times = [record["at"] for record in static.events("start") + static.events("trained")]
    return max(times) - min(times)


def plan_at(label: int, anchor_step: int, moments: tuple[float, ...], signals: tuple[str, ...],
            schedule: str | None = None, draws: tuple[float, ...] | None = None) -> Plan:
    """A fixed plan: shots ``moments`` seconds after the first batch start at ``anchor_step`` or later, each to the
    victim ``draws`` picks (default: the middle one)."""
    return Plan(label, schedule, moments, signals, draws or tuple(0.5 for _ in moments), anchor_step)


@dataclass
class Shot:
    """One signal sent (or not: ``skipped`` says why)."""

    at_s: float
    signal: str
    pid: int | None = None
    worker: str | None = None
    member: bool | None = None
    skipped: str | None = None
    where: str | None = None  # the innermost frames of the victim's main thread, from py-spy


@dataclass
class Trial:
    script: str
    plan: Plan
    home: Path
    shots: list[Shot] = field(default_factory=list)
    run: Run | None = None
    failure: tuple[str, str] | None = None  # (class, detail)
    note: str | None = None

    @property
    def signalled(self) -> dict[str, str]:
        """{worker id: signal} of the shots that hit."""
        return {shot.worker: shot.signal for shot in self.shots if shot.pid is not None and shot.worker}


# ---------------------------------------------------------------------- the gun


class Gun:
    """Runs in ``run_job``'s watcher thread: fires the plan's shots at their moments, until the launcher exits."""

    def __init__(self, trial: Trial, job: str) -> None:
        self.trial, self.job = trial, job
        self.registry = Path(elan_env(trial.home)["ELAN_HOME"]) / "jobs" / f"{job}.json"
        self.hit: set[int] = set()
        self.hit_workers: set[str] = set()

    def __call__(self, launcher: subprocess.Popen) -> None:
        started = self.anchor(launcher)
        for at_s, name, draw in zip(self.trial.plan.moments, self.trial.plan.signals, self.trial.plan.draws,
                                    strict=True):
            while time.monotonic() - started < at_s:
                if launcher.poll() is not None:
                    return
                time.sleep(0.02)
            if launcher.poll() is not None:
                return
            self.trial.shots.append(self.fire(launcher, Shot(round(time.monotonic() - started, 2), name), draw))

    def anchor(self, launcher: subprocess.Popen) -> float:
        """When the moments count from: now, or once a worker recorded a batch start at ``anchor_step`` or later."""
        step = self.trial.plan.anchor_step
        while step is not None and launcher.poll() is None and not self.reached(step):
            time.sleep(0.02)
        return time.monotonic()

    def reached(self, step: int) -> bool:
        for path in (self.trial.home / "observe").glob("observe-*.jsonl"):
            for line in path.read_text().splitlines():
                if '"event": "start"' in line and json.loads(line)["step"] >= step:
                    return True
        return False

    def fire(self, launcher: subprocess.Popen, shot: Shot, draw: float) -> Shot:
        workers, members = self.sight(launcher)
        if members is None:
            shot.skipped = "the AM did not answer"
            return shot
        holders = [pid for pid, worker in workers.items() if worker in members] or list(workers)
        victims = [pid for pid in workers if pid not in holders or len(holders) > 1]
        if not victims:
            shot.skipped = f"no victim: workers {workers}, members {sorted(members)}"
            return shot
        pid = sorted(victims)[int(draw * len(victims))]
        shot.pid, shot.worker, shot.member = pid, workers[pid], workers[pid] in members
        self.hit.add(pid)
        self.hit_workers.add(workers[pid])
        shot.where = self.shoot(pid, {**SIGNALS, **FREEZE}[shot.signal])
        return shot

    def sight(self, launcher: subprocess.Popen) -> tuple[dict[int, str], set[str] | None]:
        """The live workers and the AM's members; waits (up to ``SIGHT_S``) until the AM answers and every member
        runs or was signalled (at the job's start, the launcher spawns the members one after the other)."""
        deadline = time.monotonic() + SIGHT_S
        while True:
            workers, members = self.workers(launcher), self.members()
            seen = set(workers.values()) | self.hit_workers
            if (members and members <= seen) or time.monotonic() > deadline or launcher.poll() is not None:
                return workers, members
            time.sleep(0.05)

    def workers(self, launcher: subprocess.Popen) -> dict[int, str]:
        """{pid: worker id} of the job's live worker processes not signalled yet (those ``elan run`` logged as
        spawned: a process of the launcher's is not a worker before, the preload process never)."""
        spawned = processes.spawned_workers(self.output())
        return {pid: worker for worker, pid in spawned.items()
                if pid not in self.hit and processes.runs_script(pid, SCRIPTS)}

    def output(self) -> str:
        try:
            return (self.trial.home / "output.log").read_text(errors="replace")
        except OSError:
            return ""

    def members(self) -> set[str] | None:
        """The current generation's members by the AM (empty before the job starts), None if it is silent."""
        try:
            address = json.loads(self.registry.read_text())["address"]
            with AMClient(address, self.job, timeout_s=1.0, retries=1) as client:
                status = client.status()
        except (AMUnavailable, AMError, OSError, ValueError, KeyError):
            return None
        return {member["worker_id"] for member in status.get("members") or []}

    def shoot(self, pid: int, sig: signal.Signals) -> str | None:
        """Stop ``pid``, write its stacks to ``victim-<pid>.txt``, send ``sig``, let it go on (a SIGTERM's leave). A
        SIGTERM goes to its DataLoader processes too, as ``scancel`` or a machine's shutdown signals every process."""
        if not processes.send(pid, signal.SIGSTOP):
            return None
        loader_workers = processes.children(pid) if sig == signal.SIGTERM else []
        _wait_stopped(pid)
        path = self.trial.home / f"victim-{pid}.txt"
        try:
            with path.open("w") as stacks:
                subprocess.run([_py_spy(), "dump", "--nonblocking", "--pid", str(pid)], stdout=stacks,
                               stderr=subprocess.STDOUT, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            for loader_worker in loader_workers:
                processes.send(loader_worker, sig)
            for signum in (sig, signal.SIGCONT) if sig != signal.SIGSTOP else ():  # a frozen victim stays stopped
                if not processes.send(pid, signum):
                    break
        return _where(path, pid)


def _wait_stopped(pid: int, timeout_s: float = 2.0) -> None:
    """Until ``pid`` is stopped (``T`` in ``/proc/PID/stat``): a stack read from a running process comes out empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.005)


def _py_spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def _where(path: Path, pid: int) -> str | None:
    """Where the main thread of ``pid`` was in a ``py-spy dump``, innermost first: its innermost frame, then the
    innermost frames in lightning_elan, Lightning's trainer and loops, and the user's script (``WHERE_FRAMES``)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return None
    start = next((i for i, line in enumerate(lines) if line.startswith(f"Thread {pid} ")), None)
    if start is None:  # py-spy could not read it (exiting)
        return next((line for line in lines if line.startswith("Error")), " | ".join(lines[-3:])) or None
    stack = []
    for line in lines[start + 1 :]:
        if not line or line.startswith("Thread"):
            break
        stack.append(line)
    if not stack:
        return "no Python frame: the interpreter starting or exiting"
    marked = [frame for frame in stack[1:] if any(mark in frame for mark in WHERE_MARKS)]
    return " < ".join(_short(frame) for frame in [*stack[:1], *marked[:WHERE_FRAMES]])


WHERE_MARKS = ("lightning_elan/", "lightning/pytorch/", "pytorch_lightning/", f"{SCRIPTS.name}/")
WHERE_FRAMES = 7


def _short(frame: str) -> str:
    """``name (path/to/file.py:12)`` → ``name (file.py:12)``."""
    name, _, place = frame.partition(" (")
    return f"{name} ({place.rsplit('/', 1)[-1]}" if place else name


# ---------------------------------------------------------------------- runs


def command_of(script: str) -> tuple[str, ...]:
    return CORPUS[script].command


def static_run(root: Path, script: str, env: dict[str, str]) -> tuple[Run, float]:
    """The script's static run under ``root/<script>/static`` (made once, then read back) and its wall time."""
    home = root / script / "static"
    job = Job("static", command_of(script))
    summary = home / "static.json"
    if summary.exists():
        saved = json.loads(summary.read_text())
        return read_run(home, job, saved["returncode"]), saved["wall_s"]
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    prepare(home, script)
    started = time.monotonic()
    run = run_job(home, job, env)
    wall_s = time.monotonic() - started
    assert_ok(run)
    summary.write_text(json.dumps({"returncode": run.returncode, "wall_s": wall_s}))
    return run, wall_s


def prepare(home: Path, script: str) -> None:
    if script == "transformer_cli":
        if importlib.util.find_spec("requests") is None:
            raise SystemExit("Lightning's demo transformer imports requests before it looks for its data file")
        write_wikitext(home)


def run_trial(root: Path, script: str, plan: Plan, env: dict[str, str]) -> Trial:
    home = root / script / f"seed{plan.seed}"
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    prepare(home, script)
    trial = Trial(script, plan, home)
    job = Job(f"rk{plan.seed}", command_of(script), schedule=plan.schedule)
    trial.run = run_job(home, job, env, during=Gun(trial, job.name))
    (home / "trial.json").write_text(json.dumps({"plan": asdict(plan), "shots": [asdict(s) for s in trial.shots]},
                                                indent=1))
    return trial


# ---------------------------------------------------------------------- what must hold


def check(trial: Trial, static: Run) -> tuple[str, str] | None:
    """The first failed invariant as (class, detail), None if the trial held."""
    run = trial.run
    assert run is not None
    if "[harness] hung" in run.output:
        return "hang", _tail(run)
    if "[harness] still running" in run.output:
        return "timeout", _tail(run)
    stages: list[tuple[str, Callable[[], None]]] = [
        ("exit", lambda: assert_ok(run)),
        ("declared-dead", lambda: assert_only_signalled_died(run, trial.signalled)),
        ("sigterm-left", lambda: assert_sigterm_was_a_leave(run, trial.shots)),
        ("samples", lambda: assert_samples(run, static, trial.script, set(trial.signalled))),
        ("members", lambda: assert_steps(run, static)),
        ("final-state", lambda: assert_final(run, static, CORPUS[trial.script].exact)),
        ("outputs", lambda: OUTPUT_CHECKS_HERE.get(trial.script, OUTPUT_CHECKS[trial.script])(run, static)),
    ]
    if LATER_FIT in run.output and run.returncode != 0:  # documented: only the first fit is elastic
        trial.note = "a worker died in a later fit, which is not elastic: the job failed saying so (documented)"
        return None
    if AFTER_TRAINING in run.output:  # documented: a death is recovered from during fit only
        trial.note = "a worker died after the training was complete: its work after fit did not run (not checked)"
        stages.pop()
    for name, stage in stages:
        try:
            stage()
        except (AssertionError, OSError, KeyError, ValueError, StopIteration) as error:
            return name, f"{type(error).__name__}: {str(error)[:1500]}"
    return None


def _tail(run: Run) -> str:
    return run.excerpt()[-2500:]


def assert_only_signalled_died(run: Run, signalled: dict[str, str]) -> None:
    """No worker the driver did not signal is declared dead by the AM (a survivor taken for dead is a bug)."""
    dead = {worker for record in run.adjustments() for worker in (record.get("failure") or {}).get("dead", [])}
    assert dead <= set(signalled), f"declared dead: {sorted(dead)}, signalled: {signalled}"


def assert_sigterm_was_a_leave(run: Run, shots: list[Shot]) -> None:
    """A worker hit by SIGTERM only (its DataLoader processes with it) left: the AM never declared it dead in training
    — unless the job was finishing or shutting down, where SIGTERM takes the crash path, or the training was complete
    (README: a SIGTERM after a worker's training loop is over ends it; nothing is left to leave)."""
    killed = {shot.worker for shot in shots if shot.pid is not None and shot.signal == "KILL"}
    termed = {shot.worker for shot in shots if shot.pid is not None and shot.signal == "TERM"} - killed
    crashed = died_in_training(run) & termed
    assert not crashed or FINISHING in run.output, f"SIGTERMed {sorted(crashed)} died instead of leaving"


def died_in_training(run: Run) -> set[str]:
    """The workers the AM declared dead before the job's training was complete (outside the training loop at the
    global step after the job's last batch, the members' last batch: the death came after ``fit``)."""
    completed = max(run.digests_by_step(), default=-1) + 1
    return {worker for record in run.adjustments() for worker in (record.get("failure") or {}).get("dead", [])
            if not (record["failure"].get("outside_training") and record["step"] >= completed)}


def assert_samples(run: Run, static: Run, script: str, victims: set[str]) -> None:
    """Each epoch trained the static run's samples exactly once: what the processes recorded (of a batch redone, its
    last attempt, where micro-batches are recorded before their window's step), with the shares of victims that died
    after their last step stood and before they recorded it (:func:`unrecorded_shares`)."""
    seen = last_attempts(run) if script in ACCUMULATING else run.samples_per_epoch()
    expected = static.samples_per_epoch()
    for epoch, share in unrecorded_shares(run, static, victims).items():
        seen.setdefault(epoch, Counter()).update(share)
    assert sorted(seen) == sorted(expected), f"epochs trained: {sorted(seen)}, static: {sorted(expected)}"
    for epoch, counts in seen.items():
        duplicated = sorted(sample for sample, count in counts.items() if count > 1)
        missing = sorted(set(expected[epoch]) - set(counts), key=str)
        extra = sorted(set(counts) - set(expected[epoch]), key=str)
        assert not (duplicated or missing or extra), (
            f"epoch {epoch}: duplicated {duplicated}, missing {missing}, not in the static run {extra}")


def assert_steps(run: Run, static: Run) -> None:
    assert assert_members_agree(run) == sorted(static.digests_by_step()), "not the static run's steps"


def assert_final(run: Run, static: Run, exact: bool) -> None:
    if exact:
        assert_states_close(run.final_state(), static.final_state())
    else:
        assert_states_finite(run.final_state(), static.final_state())


def check_tune_then_fit_any_world(run: Run, static: Run | None) -> None:
    """``test_corpus.check_tune_then_fit`` less its count of processes (one start file per process that reached
    ``fit``: the corpus' elastic run has 4; here, at most the processes the seed started)."""
    before = json.loads((run.out / "before_fit.json").read_text())
    starts = [json.loads(path.read_text()) for path in sorted((run.out / "starts").glob("*.json"))]
    assert 1 <= len(starts) <= len(processes.spawned_workers(run.output)), f"{len(starts)} start files"
    for start in starts:
        assert start["suggestion"] == before["suggestion"] == start["lr"]
        assert start["losses"] == before["losses"]
        assert abs(start["baseline"][0]["val_loss"] - before["baseline"][0]["val_loss"]) <= TOLERANCE
    assert static is not None
    reference = json.loads((static.out / "before_fit.json").read_text())
    assert before["suggestion"] == reference["suggestion"]
    assert abs(before["baseline"][0]["val_loss"] - reference["baseline"][0]["val_loss"]) <= TOLERANCE
    after = json.loads((run.out / "after_fit.json").read_text())["validate"][0]["val_loss"]
    assert abs(after - json.loads((static.out / "after_fit.json").read_text())["validate"][0]["val_loss"]) <= TOLERANCE


def check_fit_bounds_any_world(run: Run, static: Run | None) -> None:
    """``test_corpus.check_fit_bounds_collectives`` less the corpus schedule's leavers and final world."""
    fit_bounds_summary(run)
    assert static is not None
    assert_fit_bounds_alike(run, static)


OUTPUT_CHECKS_HERE: dict[str, Callable[[Run, Run | None], None]] = {
    "tune_then_fit": check_tune_then_fit_any_world,
    "fit_bounds_collectives": check_fit_bounds_any_world,
}


# ---------------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True, choices=sorted(CORPUS))
    parser.add_argument("--seed", type=int, default=1, help="trial i uses seed S + i")
    parser.add_argument("--seeds", type=int, default=1, help="how many trials")
    parser.add_argument("--signal", choices=[*SIGNALS, *FREEZE, "MIXED"], default="KILL",
                        help="MIXED: KILL or TERM by the seed; STOP freezes the victim (see FREEZE)")
    parser.add_argument("--dir", type=Path, default=None, help="the jobs' files (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the files of trials that held too")
    parser.add_argument("--in-training", action="store_true",
                        help="draw the moments over the training loop (from the first batch), not over the whole job")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a job under way is stopped by run_job's cleanup
    root = args.dir or Path(tempfile.mkdtemp(prefix="elan-random-kills-"))
    print(f"files in {root}", flush=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
    static, span_s = static_run(root, args.script, env)
    held, failed = 0, []
    for seed in range(args.seed, args.seed + args.seeds):
        plan = plan_for(seed, (training_span(static) if args.in_training else span_s) * SPAN_FACTOR, args.signal,
                        GROW_SCHEDULES.get(args.script, GROW_SCHEDULE))
        plan = replace(plan, anchor_step=0) if args.in_training else plan
        ok, took_s = one(root, args.script, plan, static, env, args.keep)
        span_s = max(span_s, took_s) if not args.in_training else span_s  # a loaded machine runs a job longer
        held += ok
        failed += [] if ok else [seed]
    print(f"held: {held} of {args.seeds}" + (f"; failed seeds: {failed}" if failed else ""), flush=True)
    return 0 if held == args.seeds else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def one(root: Path, script: str, plan: Plan, static: Run, env: dict[str, str], keep: bool) -> tuple[bool, float]:
    """Run and check one trial; returns whether it held and how long its job ran."""
    started = time.monotonic()
    trial = run_trial(root, script, plan, env)
    took_s = time.monotonic() - started
    trial.failure = check(trial, static)
    shots = "; ".join(_describe(shot) for shot in trial.shots) or "no shot fired"
    verdict = "held" if trial.failure is None else f"FAILED [{trial.failure[0]}]: {trial.failure[1]}"
    verdict += f" ({trial.note})" if trial.note else ""
    print(f"{script} seed {plan.seed} ({plan.schedule or 'static'}, {took_s:.0f} s): {shots}: {verdict}", flush=True)
    if trial.failure is None and not keep:
        shutil.rmtree(trial.home, ignore_errors=True)
    return trial.failure is None, took_s


def _describe(shot: Shot) -> str:
    if shot.skipped:
        return f"SIG{shot.signal} at {shot.at_s} s skipped ({shot.skipped})"
    role = "member" if shot.member else "non-member"
    return f"SIG{shot.signal} at {shot.at_s} s to {shot.worker} ({role}) in [{shot.where}]"


if __name__ == "__main__":
    sys.exit(main())
