"""Goodput under failures: the time to reach N optimizer steps with a SIGKILL every T seconds (issue 27, item 5).

    python -m bench.goodput --models 1m,25m --periods 20,60 --systems elan,torchrun,torchft,restart --out DIR
    (also the ``goodput`` section of ``python -m bench.run``)

Every system trains the benchmark's workload (bench/workload.py's MLP, Adam, global batch 48) with 3 workers on CPU
(gloo, 127.0.0.1), first without failures, then once per period T with a SIGKILL of one training process every T
seconds: the first T s after the job's first completed step, each next one T s after the previous kill, until the
job has completed step N. The victim is a random process of non-zero rank (seeded; torchft: replica group 1 or 2)
that is running the training script; when none is (all of them restarting), the kill waits for one and the next
period counts from the actual kill. Replacements are on everywhere:

* ``elan``: ``elan run --nproc 3 --replace-failed``: the survivors go on, the launcher starts a replacement.
* ``torchrun``: one torchrun elastic agent (c10d, ``--max-restarts`` 1000, bench/faults.py's command); it restarts all
  workers, which resume from the script's latest checkpoint (every K steps, durable, as torch's docs prescribe).
* ``torchft``: torchft 0.2.0 replica groups (bench/torchft_train.py, 16 samples per group and step, the tolerant DDP
  comm hook without which its survivors crash) with a lighthouse (bench/torchft_peer.py's settings); the harness,
  acting as torchft's scheduler, restarts a dead group at once in its slot, and it heals from its peers.
* ``restart``: stop-and-restart: 3 plain Lightning ``ddp`` processes checkpointing every K steps; when one dies the
  harness stops the others and starts a new set, which resumes from the latest checkpoint.

Both times run from the job's first completed step to the first completion of step N (start-up, launch → first
step, is reported apart): goodput = failure-free time ÷ time with failures, per system. A job that does not reach N
before its deadline, or whose launcher gives up, is recorded with goodput 0 and the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import write_stop_file
from bench.procs import LOOPBACK, Children, bench_env, free_port, kill_strays
from bench.sizes import MODEL_SIZES

log = logging.getLogger(__name__)

SYSTEMS = ("elan", "torchrun", "torchft", "restart")
DEFAULT_STEPS = {"tiny": 1500, "1m": 2000, "11m": 250, "25m": 120}  # ≈ 45–90 s failure-free on the 2-core box
DEFAULT_CKPT_EVERY = {"tiny": 100, "1m": 100, "11m": 10, "25m": 10}  # a checkpoint every ≈ 2–4 s of training
POLL_S = 0.1
EXIT_GRACE_S = 60.0  # after step N: how long the job may take to exit by itself
MAX_GROUP_RESTARTS = 200  # torchft / restart: the harness gives up after this many restarts
TRAINING_MARKERS = ("bench.train", "bench.torchft_train")


class JobFailed(RuntimeError):
    """The job cannot reach step N: its launcher exited, or the harness gave up."""


@dataclass(frozen=True)
class Settings:
    """One run's settings."""

    system: str
    model: str
    steps: int
    period_s: float | None  # None: the failure-free run
    ckpt_every: int
    deadline_s: float
    world: int = 3
    global_batch: int = 48
    coordinate_every: int = 10
    seed: int = 0
    accelerator: str = "cpu"


@dataclass
class Kill:
    """One SIGKILL: when (after the first step), whom, and how far the job had got."""

    at_s: float
    pid: int
    rank: int
    label: str
    max_step: int
    deferred_s: float


@dataclass
class Run:
    """One run's outcome, times in seconds."""

    system: str
    model: str
    steps: int
    period_s: float | None
    launched_at: float
    startup_s: float | None = None  # launch → first completed step
    time_s: float | None = None  # first completed step → first completion of step N
    reached_step: int = -1
    kills: list[Kill] = field(default_factory=list)
    restarts: int = 0  # processes (torchft) or sets (restart) the harness started again
    exit_code: int | None = None
    error: str | None = None
    work_dir: str = ""
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "kills"}, "kills": [asdict(k) for k in self.kills]}


# ---------------------------------------------------------------------- following the step files


class StepTail:
    """Follows a job's step files, reading only the lines added since the last call."""

    def __init__(self, steps_dir: Path, target: int) -> None:
        self.steps_dir = steps_dir
        self.target = target
        self.offsets: dict[Path, int] = {}
        self.pids: dict[Path, int] = {}
        self.workers: dict[str, str] = {}  # file stem → the header's worker id (torchrun: RANK)
        self.last: dict[Path, dict[str, Any]] = {}
        self.first_time: float | None = None
        self.reached_time: float | None = None
        self.max_step = -1

    def update(self) -> None:
        """Read the new complete lines of every step file."""
        if not self.steps_dir.exists():
            return
        for path in self.steps_dir.glob("*.jsonl"):
            with path.open("rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                self._record(path, line)

    def _record(self, path: Path, line: bytes) -> None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return
        if "event" in record:
            self.pids[path] = int(record["pid"])
            self.workers[path.stem] = str(record.get("worker"))
            return
        self.last[path] = record
        step, when = int(record["s"]), float(record["t"])
        self.max_step = max(self.max_step, step)
        self.first_time = when if self.first_time is None else min(self.first_time, when)
        if step >= self.target and (self.reached_time is None or when < self.reached_time):
            self.reached_time = when

    def ranked(self) -> list[tuple[int, int | None, str]]:
        """(pid, rank at its latest step or None before its first, file stem) of every process that started."""
        return [(pid, int(self.last[path]["r"]) if path in self.last else None, path.stem)
                for path, pid in self.pids.items()]


def is_training_process(pid: int) -> bool:
    """Whether ``pid`` runs one of the benchmark's training scripts (a zombie or a reused pid does not)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(marker in command for marker in TRAINING_MARKERS)


# ---------------------------------------------------------------------- the systems


class Job:
    """A running job: ``start``, supervise with ``tick``, list ``victims``, ``finish``, ``stop``."""

    def __init__(self, settings: Settings, out: Path, children: Children) -> None:
        self.settings = settings
        self.out = out
        self.children = children
        self.steps_dir = out / "steps"
        self.restarts = 0
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Supervise (restart what the system's scheduler would restart); raise ``JobFailed`` if it is over."""

    def victims(self, tail: StepTail) -> list[tuple[int, int, str]]:
        """(pid, rank, label) of the live training processes not of rank 0 (elan: a replacement that has not
        trained yet counts, as rank -1)."""
        return [(pid, -1 if rank is None else rank, label) for pid, rank, label in tail.ranked()
                if rank != 0 and is_training_process(pid)]

    def finish(self, timeout_s: float) -> int | None:
        """Wait for the job to exit by itself after step N; its exit code (None: still running)."""
        return wait_exit(self.procs[:1], timeout_s)

    def stop(self) -> None:
        for proc in self.procs:
            self.children.stop(proc, grace_s=5.0)
        tail = StepTail(self.steps_dir, 0)
        tail.update()
        for marker in TRAINING_MARKERS:  # workers a launcher left behind (torchrun starts them in their own groups)
            kill_strays(tail.pids.values(), marker)


def wait_exit(procs: list[subprocess.Popen], timeout_s: float) -> int | None:
    """The first non-zero exit code of ``procs`` once all exited (0 if none), None if one still runs at the end."""
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return next((int(p.returncode) for p in procs if p.returncode), 0)



class ElanJob(Job):
    """``elan run --nproc 3 --replace-failed``; the job ends at ``--max-steps N``."""

    def start(self) -> None:
        from bench.elan_runs import elan_command
        from bench.faults import FaultScenario

        s = self.settings
        scenario = FaultScenario(s.model, world=s.world, global_batch=s.global_batch, accelerator=s.accelerator)
        job = f"bench-goodput-{s.model}-{int(time.time() * 1000)}"
        command = elan_command(scenario.scenario(), job, self.out / "state", self.steps_dir, self.out / "stop",
                               s.coordinate_every, max_steps=s.steps, nproc=s.world, run_options=["--replace-failed"])
        env = bench_env({"ELAN_HOME": str(self.out / "elan-home")})
        self.procs.append(self.children.start(command, env, self.out / "elan-run.log"))

    def tick(self) -> None:
        code = self.procs[0].poll()
        if code is not None:
            raise JobFailed(f"elan run exited with {code} before step {self.settings.steps}")


class TorchrunJob(Job):
    """One torchrun elastic agent, 3 workers, c10d; a durable checkpoint every K steps, resumed from at restart."""

    def start(self) -> None:
        from bench.faults import FaultScenario, torchrun_command

        s = self.settings
        scenario = FaultScenario(s.model, kills=998, world=s.world, global_batch=s.global_batch)  # max-restarts 1000
        train_args = ["--launcher", "torchrun", "--model", s.model, "--global-batch", str(s.global_batch),
                      "--max-steps", str(s.steps), "--steps-dir", str(self.steps_dir), "--label", "torchrun",
                      "--accelerator", s.accelerator, "--ckpt-dir", str(self.out / "checkpoint"),
                      "--ckpt-every", str(s.ckpt_every)]
        command = torchrun_command(scenario, f"{LOOPBACK}:{free_port()}", f"goodput-{int(time.time() * 1000)}",
                                   train_args)
        env = bench_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "WARNING"})
        self.procs.append(self.children.start(command, env, self.out / "logs" / "agent.log"))

    def tick(self) -> None:
        code = self.procs[0].poll()
        if code is not None:
            raise JobFailed(f"the torchrun agent exited with {code} before step {self.settings.steps}")

    def victims(self, tail: StepTail) -> list[tuple[int, int, str]]:
        """Workers of non-zero ``RANK`` (their step file's header), started or training."""
        heads = {path.stem: pid for path, pid in tail.pids.items()}
        return [(pid, int(tail.workers.get(label, "0")), label) for label, pid in heads.items()
                if tail.workers.get(label, "0") != "0" and is_training_process(pid)]


class RestartJob(Job):
    """Stop-and-restart: 3 plain ``ddp`` processes; when one dies the harness stops the set and starts a new one."""

    def start(self) -> None:
        self.current = self._launch()

    def _launch(self) -> list[subprocess.Popen]:
        from bench.restart_runs import launch_ddp_set

        s = self.settings
        args = ["--model", s.model, "--global-batch", str(s.global_batch), "--max-steps", str(s.steps),
                "--steps-dir", str(self.steps_dir), "--ckpt-dir", str(self.out / "checkpoint"),
                "--ckpt-every", str(s.ckpt_every)]
        procs = launch_ddp_set(self.children, s.world, args, f"set{self.restarts:03d}", self.out, s.accelerator)
        self.procs += procs
        return procs

    def tick(self) -> None:
        codes = [proc.poll() for proc in self.current]
        if not any(code not in (None, 0) for code in codes):
            return
        for proc in self.current:  # the survivors are stuck in a collective with the dead one: stop them all
            self.children.stop(proc, grace_s=5.0)
        if self.restarts >= MAX_GROUP_RESTARTS:
            raise JobFailed(f"stop-and-restart gave up after {self.restarts} restarts")
        self.restarts += 1
        self.current = self._launch()

    def victims(self, tail: StepTail) -> list[tuple[int, int, str]]:
        return [(proc.pid, rank, f"set{self.restarts:03d}-r{rank}") for rank, proc in enumerate(self.current)
                if rank != 0 and proc.poll() is None and is_training_process(proc.pid)]

    def finish(self, timeout_s: float) -> int | None:
        return wait_exit(self.current, timeout_s)


class TorchftJob(Job):
    """torchft 0.2.0: a lighthouse and 3 replica groups; a dead group is restarted in its slot by the harness."""

    def start(self) -> None:
        from bench.torchft_peer import Settings as PeerSettings
        from bench.torchft_peer import start_group, start_lighthouse

        s = self.settings
        self.peer = PeerSettings(model=s.model, batch=s.global_batch // s.world, timeout_s=120.0)
        write_stop_file(self.out / "stop", s.steps)  # every group stops after the step that reaches N
        self.lighthouse, self.address = start_lighthouse(self.peer, self.out, self.children)
        self.start_group = start_group
        self.groups = [self._group(slot, "start") for slot in range(s.world)]

    def _group(self, slot: int, tag: str) -> subprocess.Popen:
        proc = self.start_group(slot, self.address, self.peer, self.out, self.children, tag)
        self.procs.append(proc)
        return proc

    def tick(self) -> None:
        if self.lighthouse.poll() is not None:
            raise JobFailed(f"the torchft lighthouse exited with {self.lighthouse.returncode}")
        for slot, proc in enumerate(self.groups):
            if proc.poll() is None or proc.returncode == 0:
                continue
            if self.restarts >= MAX_GROUP_RESTARTS:
                raise JobFailed(f"the harness gave up after {self.restarts} replica group restarts")
            self.restarts += 1
            log.info("torchft: replica group %d exited with %d; restarted", slot, proc.returncode)
            self.groups[slot] = self._group(slot, f"restart{self.restarts:03d}")

    def victims(self, tail: StepTail) -> list[tuple[int, int, str]]:
        return [(proc.pid, slot, f"group{slot}") for slot, proc in enumerate(self.groups)
                if slot != 0 and proc.poll() is None and is_training_process(proc.pid)]

    def finish(self, timeout_s: float) -> int | None:
        return wait_exit(self.groups, timeout_s)

    def stop(self) -> None:
        super().stop()
        self.children.stop(self.lighthouse, grace_s=5.0)


JOBS: dict[str, type[Job]] = {"elan": ElanJob, "torchrun": TorchrunJob, "torchft": TorchftJob, "restart": RestartJob}


# ---------------------------------------------------------------------- one run


def run_once(settings: Settings, out: Path, children: Children) -> Run:
    """Start the job, kill every ``period_s`` after its first step until it reaches step N; never past the deadline."""
    out.mkdir(parents=True, exist_ok=True)
    job = JOBS[settings.system](settings, out, children)
    run = Run(settings.system, settings.model, settings.steps, settings.period_s, time.time(), work_dir=str(out))
    tail = StepTail(job.steps_dir, settings.steps)
    started = time.monotonic()
    try:
        job.start()
        drive(job, tail, run, random.Random(f"{settings.seed}-{settings.system}-{settings.model}-{settings.period_s}"))
        run.exit_code = job.finish(EXIT_GRACE_S)
    except (JobFailed, TimeoutError, RuntimeError) as exc:
        run.error = f"{type(exc).__name__}: {exc} (logs in {out})"
        log.error("%s %s T=%s: %s", settings.system, settings.model, settings.period_s, run.error)
    finally:
        job.stop()
        tail.update()
        run.restarts = job.restarts
        run.reached_step = tail.max_step
        run.wall_s = time.monotonic() - started
        if tail.first_time is not None:
            run.startup_s = tail.first_time - run.launched_at
        if tail.first_time is not None and tail.reached_time is not None:
            run.time_s = tail.reached_time - tail.first_time
    return run


def drive(job: Job, tail: StepTail, run: Run, rng: random.Random) -> None:
    """Supervise and kill until step N; raises ``TimeoutError`` at the deadline."""
    settings = job.settings
    deadline = time.monotonic() + settings.deadline_s
    next_kill: float | None = None
    due_since: float | None = None
    while True:
        tail.update()
        if tail.reached_time is not None:
            return
        job.tick()
        now = time.time()
        if next_kill is None and tail.first_time is not None and settings.period_s:
            next_kill = tail.first_time + settings.period_s
        if next_kill is not None and now >= next_kill:
            due_since = due_since or next_kill
            kill = kill_one(job, tail, rng, now - tail.first_time, now - due_since)  # type: ignore[operator]
            if kill is not None:
                run.kills.append(kill)
                next_kill, due_since = time.time() + settings.period_s, None  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"did not finish within {settings.deadline_s:.0f} s: step {tail.max_step} of "
                               f"{settings.steps} reached, {len(run.kills)} kill(s)")
        time.sleep(POLL_S)


def kill_one(job: Job, tail: StepTail, rng: random.Random, at_s: float, deferred_s: float) -> Kill | None:
    """SIGKILL a random live training process of non-zero rank; None if there is none right now."""
    victims = job.victims(tail)
    if not victims:
        return None
    pid, rank, label = rng.choice(sorted(victims))
    if not is_training_process(pid):
        return None
    os.kill(pid, signal.SIGKILL)
    log.info("%s %s: SIGKILL %s (rank %d, pid %d) at %.1f s, step %d", job.settings.system, job.settings.model,
             label, rank, pid, at_s, tail.max_step)
    return Kill(round(at_s, 3), pid, rank, label, tail.max_step, round(deferred_s, 3))


# ---------------------------------------------------------------------- the matrix


def run_matrix(models: list[str], systems: list[str], periods: list[float], steps: dict[str, int],
               ckpt_every: dict[str, int], repeats: int, out: Path, children: Children, results: dict[str, Any],
               save: Any, deadline_factor: float = 3.0, baseline_deadline_s: float = 600.0, seed: int = 0,
               baseline: bool = True) -> None:
    """Per model, system and repeat: the failure-free run (unless ``baseline`` is off), then one run per period;
    ``results['runs']`` grows."""
    runs = results.setdefault("runs", [])
    for model in models:
        for repeat in range(repeats):
            for system in systems:
                free: dict[str, Any] = {}
                if baseline:
                    base = Settings(system, model, steps[model], None, ckpt_every[model], baseline_deadline_s,
                                    seed=seed)
                    free = record(runs, run_once(base, out / model / system / f"r{repeat}-free", children), repeat)
                    save()
                for period in periods:
                    deadline = failure_deadline(free, deadline_factor, baseline_deadline_s)
                    settings = Settings(system, model, steps[model], period, ckpt_every[model], deadline,
                                        seed=seed + repeat)
                    record(runs, run_once(settings, out / model / system / f"r{repeat}-T{period:g}", children),
                           repeat)
                    save()


def failure_deadline(baseline: dict[str, Any], factor: float, default_s: float) -> float:
    """A run with failures gets ``factor`` × the failure-free start-up and time (or ``default_s`` without one)."""
    if baseline.get("time_s") is None:
        return default_s
    return max(120.0, factor * (baseline["time_s"] + (baseline["startup_s"] or 0.0)))


def record(runs: list[dict[str, Any]], run: Run, repeat: int) -> dict[str, Any]:
    entry = {**run.as_dict(), "repeat": repeat}
    runs.append(entry)
    log.info("%s %s T=%s: %s s to step %d, %d kill(s)%s", run.system, run.model, run.period_s,
             f"{run.time_s:.1f}" if run.time_s is not None else "—", run.steps, len(run.kills),
             f"; {run.error}" if run.error else "")
    return entry


# ---------------------------------------------------------------------- summary and table


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, system, period): medians and ranges of time and goodput over repeats."""
    rows = []
    keys = sorted({(r["model"], r["system"], r["period_s"] or 0.0) for r in runs},
                  key=lambda k: (k[0], SYSTEMS.index(k[1]) if k[1] in SYSTEMS else 99, k[2]))
    for model, system, period in keys:
        free = [r for r in runs if (r["model"], r["system"], r["period_s"]) == (model, system, None)]
        free_times = [r["time_s"] for r in free if r["time_s"] is not None and not r["error"]]
        reference = statistics.median(free_times) if free_times else None
        group = [r for r in runs if (r["model"], r["system"], r["period_s"] or 0.0) == (model, system, period)]
        rows.append(summary_row(model, system, period or None, group, reference))
    return rows


def summary_row(model: str, system: str, period: float | None, group: list[dict[str, Any]],
                reference: float | None) -> dict[str, Any]:
    times = [r["time_s"] for r in group if r["time_s"] is not None and not r["error"]]
    goodputs = [goodput(r, reference) for r in group]
    lost = [(r["time_s"] - reference) / len(r["kills"]) for r in group
            if r["time_s"] is not None and not r["error"] and r["kills"] and reference is not None]
    return {"model": model, "system": system, "period_s": period, "steps": group[0]["steps"], "runs": len(group),
            "time_s": spread(times), "startup_s": spread([r["startup_s"] for r in group if r["startup_s"]]),
            "goodput": spread([g for g in goodputs if g is not None]), "kills": [len(r["kills"]) for r in group],
            "lost_per_kill_s": spread(lost), "restarts": [r["restarts"] for r in group],
            "errors": [r["error"] for r in group if r["error"]]}


def goodput(run: dict[str, Any], reference: float | None) -> float | None:
    """failure-free time ÷ this run's time; 0 for a run that did not reach N; None without a reference."""
    if run["error"] or run["time_s"] is None:
        return 0.0
    return None if reference is None else reference / run["time_s"]


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "n": len(values)}


def fmt(value: dict[str, float] | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    text = f"{value['median']:.{digits}f}"
    if value["n"] > 1:
        text += f" ({value['low']:.{digits}f}–{value['high']:.{digits}f})"
    return text


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# Goodput under failures", "",
        f"`{results['command']}`; {env['date']}; commit {env.get('commit', '?')}; {env['cores']} cores "
        f"({env['cpu']}); load average {env['loadavg_start'][0]:.2f} at the start, "
        f"{env.get('loadavg_end', [float('nan')])[0]:.2f} at the end; {env.get('wall_s', 0) / 60:.1f} min.", "",
        "Seconds from the first completed step to step N; median (min–max) over repeats where there are several. "
        "Goodput = failure-free time ÷ time with failures (the same system's). Lost per kill = (time − "
        "failure-free time) ÷ kills.", "",
        "| model | system | N | T (s) | time to N (s) | start-up (s) | kills | goodput | lost per kill (s) | "
        "restarts by the harness | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summarise(results.get("runs", [])):
        period = "no kills" if row["period_s"] is None else f"{row['period_s']:g}"
        kills = ", ".join(map(str, row["kills"]))
        lines.append(f"| {row['model']} | {row['system']} | {row['steps']} | {period} | {fmt(row['time_s'])} | "
                     f"{fmt(row['startup_s'])} | {kills} | {fmt(row['goodput'], 2)} | "
                     f"{fmt(row['lost_per_kill_s'])} | {', '.join(map(str, row['restarts']))} | "
                     f"{'; '.join(row['errors'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- CLI


def parse_per_model(text: str, models: list[str], defaults: dict[str, int]) -> dict[str, int]:
    """``"3000"`` (every model) or ``"1m:3000,25m:180"``; models not named keep ``defaults``."""
    values = {model: defaults.get(model, 100) for model in models}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        model, _, number = item.rpartition(":")
        if model:
            values[model] = int(number)
        else:
            values = dict.fromkeys(models, int(number))
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1m,25m", help=f"comma-separated, of {', '.join(MODEL_SIZES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--periods", default="20,60", help="seconds between kills, comma-separated")
    parser.add_argument("--steps", default="", help=f"N: one number, or model:N pairs (default {DEFAULT_STEPS})")
    parser.add_argument("--ckpt-every", default="", help=f"K for torchrun and restart (default {DEFAULT_CKPT_EVERY})")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--deadline-factor", type=float, default=3.0,
                        help="a run with failures is stopped after this many times the failure-free launch → N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="the failure-free run of each system (without it: no goodput, times only)")
    parser.add_argument("--deadline-s", type=float, default=600.0,
                        help="deadline of a failure-free run (and of a run with failures without one)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/goodput"), help="goodput.json and .md")
    parser.add_argument("--work-dir", type=Path, default=None, help="step files and logs (default: a temp dir, kept)")
    return parser.parse_args(argv)


def environment() -> dict[str, Any]:
    from bench.run import environment as base

    env = base()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = "?"
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the matrix; 1 if a run failed to reach N (recorded in goodput.json/.md)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) {sorted(unknown)}: use {', '.join(SYSTEMS)}")
    periods = [float(p) for p in args.periods.split(",") if p.strip()]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-goodput-"))
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(), "arguments": {k: str(v) for k, v in vars(args).items()},
                               "command": " ".join(["python -m bench.goodput", *(argv or sys.argv[1:])]),
                               "steps": parse_per_model(args.steps, models, DEFAULT_STEPS),
                               "ckpt_every": parse_per_model(args.ckpt_every, models, DEFAULT_CKPT_EVERY)}
    children = Children()
    started = time.monotonic()

    def save() -> None:
        results["environment"]["loadavg_end"] = os.getloadavg()
        results["environment"]["wall_s"] = time.monotonic() - started
        results["summary"] = summarise(results.get("runs", []))
        (args.out / "goodput.json").write_text(json.dumps(results, indent=1))
        (args.out / "goodput.md").write_text(markdown(results))

    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
    log.info("work dir %s; results to %s", work, args.out / "goodput.json")
    try:
        run_matrix(models, systems, periods, results["steps"], results["ckpt_every"], args.repeats, work, children,
                   results, save, deadline_factor=args.deadline_factor, baseline_deadline_s=args.deadline_s,
                   seed=args.seed, baseline=args.baseline)
    finally:
        children.stop_all()
        save()
    print(markdown(results))
    return 1 if any(run["error"] for run in results.get("runs", [])) else 0


if __name__ == "__main__":
    raise SystemExit(main())
