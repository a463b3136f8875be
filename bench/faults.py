"""Crash recovery: the time from a SIGKILL of one worker to the job's next completed step.

    python -m bench.faults --models 1m,25m --kills 10 --out DIR     (also the ``faults`` section of bench.run)

Every job trains bench/train.py with 3 workers. After ``warmup_steps`` the harness SIGKILLs one training process of
a non-zero rank (``os.kill(pid, SIGKILL)`` of the process that writes the step file, never its launcher), waits for
the job to train ``settle_steps`` past the highest step reached before the kill (plus 0…``ckpt_every`` − 1 steps
chosen at random, so that kills do not always land at the same distance from torchrun's last checkpoint), and kills
again, ``kills`` times.

torchrun elastic: one agent with ``--nproc-per-node=3``, c10d rendezvous on 127.0.0.1, ``--max-restarts`` above the
number of kills. The agent sees the dead worker at its next monitor tick, stops the other two and starts 3 new
workers, which resume from the script's latest checkpoint (``--ckpt-every`` steps, bench/train.py) and redo the steps
since it.

elan: ``elan run --nproc 3 [--replace-failed]``. The survivors drop the dead member and go on in a new generation
(the interrupted step is redone); with ``--replace-failed`` the launcher starts a replacement, otherwise the harness
asks for one (``add 1``) so that every kill meets 3 workers. The same job first makes ``planned_removals`` ×
(``remove 1``, ``add 1``): the planned 3→2 removal pause, for comparison. Without crash recovery in ``elan run`` the
job ends after the first kill: the run then records a clear error and keeps the planned-removal figures.

Per kill, from the workers' step files (bench/analysis.py):

* ``recovery_s``: kill → the first step completed by the new configuration, whatever its number (torchrun: by a
  worker started after the kill, a redone step included; elan: by a survivor in the new generation, i.e. at a
  smaller world size, or at a step the dead worker could not have taken part in). This is "the next completed step".
* ``progress_s``: kill → the first completion, by the new configuration, of a step beyond the highest step the job
  had completed before the kill (training progress regained; torchrun's redone steps are inside it).
* ``redone_steps``: steps completed before the kill that the new configuration completed again.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.analysis import ProcessSteps, StepRecord, load_steps
from bench.common import STALL_S, Follower, Scenario, stop_margin, write_stop_file
from bench.procs import LOOPBACK, Children, bench_env, free_port, kill_strays
from bench.sizes import MODEL_SIZES

log = logging.getLogger(__name__)

LAUNCHERS = ("torchrun", "elan")
TRAINING_MARKER = "bench.train"  # a pid is only killed if its command line runs the benchmark's training script
POLL_S = 0.05
TYPICAL_WINDOW = 8  # steps before a kill whose median duration is reported as its typical step

# a predicate on (process, record): does this step belong to the configuration formed after the kill?
NewConfig = Callable[[ProcessSteps, StepRecord], bool]


class RecoveryFailed(RuntimeError):
    """The job did not come back after a kill (it exited, or made no step in time): the run stops there."""


@dataclass(frozen=True)
class FaultScenario:
    model: str
    kills: int = 10
    world: int = 3
    warmup_steps: int = 10
    settle_steps: int = 10
    planned_removals: int = 2  # elan: (remove 1, add 1) cycles before the kills
    replace_failed: bool = True  # elan: pass --replace-failed to elan run
    accelerator: str = "cpu"
    ckpt_every: int = 10  # torchrun: the training script's checkpoint interval
    coordinate_every: int = 10  # elan
    global_batch: int = 48
    recovery_timeout_s: float = 180.0  # kill → first step of the new configuration
    timeout_s: float = 600.0
    seed: int = 0

    def scenario(self) -> Scenario:
        """The adjustment benchmark's settings this run shares (for elan_command and the stop margin)."""
        return Scenario(self.model, warmup_steps=self.warmup_steps, settle_steps=self.settle_steps,
                        global_batch=self.global_batch, accelerator=self.accelerator, timeout_s=self.timeout_s)


@dataclass(frozen=True)
class KillEvent:
    """One SIGKILL the harness sent."""

    index: int
    pid: int
    worker: str
    rank: int
    world: int
    killed_at: float  # time.time() just before os.kill

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Recovery:
    """What the step files say about one kill."""

    event: KillEvent
    last_step: int  # the highest step completed before the kill
    next_step: int | None = None  # the first step the new configuration completed
    recovery_s: float | None = None
    progress_s: float | None = None
    redone_steps: int | None = None
    typical_step_s: float | None = None  # median step before the kill
    respawn_s: float | None = None  # torchrun: kill → the first new worker process started (the agent's share)

    def as_dict(self) -> dict[str, Any]:
        return {**self.event.as_dict(), "last_step": self.last_step, "next_step": self.next_step,
                "recovery_s": self.recovery_s, "progress_s": self.progress_s, "redone_steps": self.redone_steps,
                "typical_step_s": self.typical_step_s, "respawn_s": self.respawn_s}


@dataclass
class FaultRun:
    launcher: str
    model: str
    launched_at: float
    steps_dir: Path
    command: list[str] = field(default_factory=list)
    kills: list[Recovery] = field(default_factory=list)
    planned_removals: list[dict[str, Any]] = field(default_factory=list)  # elan: ElanAdjustment.as_dict()
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "model": self.model, "launched_at": self.launched_at,
                "steps_dir": str(self.steps_dir), "command": self.command,
                "kills": [kill.as_dict() for kill in self.kills], "planned_removals": self.planned_removals,
                "error": self.error}


# ---------------------------------------------------------------------- analysis (pure)


def analyse_kill(processes: Sequence[ProcessSteps], event: KillEvent, new_config: NewConfig,
                 restarted: bool = False) -> Recovery:
    """``recovery_s``, ``progress_s`` and ``redone_steps`` of one kill (None where the job never got there);
    ``restarted``: the new configuration is new processes (torchrun), whose first spawn gives ``respawn_s``."""
    before = [record for process in processes for record in process.steps if record.time <= event.killed_at]
    last_step = max((record.step for record in before), default=-1)
    result = Recovery(event, last_step, typical_step_s=typical_step(processes, event.killed_at, last_step))
    spawned = [process.spawn for process in processes if process.start >= event.killed_at]
    if restarted and spawned:
        result.respawn_s = min(spawned) - event.killed_at
    after = sorted((record.time, record.step) for process in processes for record in process.steps
                   if record.time > event.killed_at and new_config(process, record))
    if not after:
        return result
    first_time, result.next_step = after[0]
    result.recovery_s = first_time - event.killed_at
    result.redone_steps = max(0, last_step + 1 - result.next_step)
    beyond = next((when for when, step in after if step > last_step), None)
    result.progress_s = None if beyond is None else beyond - event.killed_at
    return result


def typical_step(processes: Sequence[ProcessSteps], until: float, last_step: int) -> float | None:
    """Median time between consecutive steps among the ``TYPICAL_WINDOW`` steps up to ``last_step``, from the step
    completions before ``until`` (the kill) only: an earlier kill's redone steps do not count twice."""
    series: dict[int, float] = {}
    for process in processes:
        for record in process.steps:
            if record.time <= until:
                series[record.step] = max(series.get(record.step, record.time), record.time)
    # a step redone after an earlier restart: its latest completion is the one next to its neighbours
    window = [series[k] - series[k - 1] for k in range(last_step - TYPICAL_WINDOW + 1, last_step + 1)
              if k in series and k - 1 in series and series[k] > series[k - 1]]
    return statistics.median(window) if window else None


def started_after(killed_at: float) -> NewConfig:
    """torchrun: the new configuration is the workers started after the kill."""
    return lambda process, record: process.start >= killed_at and record.time > killed_at


def survivors_of(event: KillEvent, dead_last_step: int) -> NewConfig:
    """elan: a step of another process at a new world size, or past the step the dead worker could finish with
    them (its last step + 1: an all-reduce it had joined before it died)."""

    def new(process: ProcessSteps, record: StepRecord) -> bool:
        if process.pid == event.pid or record.time <= event.killed_at:
            return False
        return record.world != event.world or record.step > dead_last_step + 1

    return new


def new_config_of(launcher: str, processes: Sequence[ProcessSteps], event: KillEvent) -> NewConfig:
    if launcher == "torchrun":
        return started_after(event.killed_at)
    dead = next((process for process in processes if process.pid == event.pid), None)
    return survivors_of(event, dead.max_step if dead else -1)


def analyse_run(launcher: str, processes: Sequence[ProcessSteps], events: Sequence[KillEvent]) -> list[Recovery]:
    return [analyse_kill(processes, event, new_config_of(launcher, processes, event), launcher == "torchrun")
            for event in events]


# ---------------------------------------------------------------------- killing and waiting


def is_training_process(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return TRAINING_MARKER in command


def sigkill(pid: int, worker: str, rank: int, world: int, index: int) -> KillEvent:
    """SIGKILL one training process (refused for any other pid); the event's time is taken just before."""
    if not is_training_process(pid):
        raise RuntimeError(f"pid {pid} ({worker}) is not a running {TRAINING_MARKER} process: not killed")
    event = KillEvent(index, pid, worker, rank, world, time.time())
    os.kill(pid, signal.SIGKILL)
    log.info("kill %d: SIGKILL to %s (rank %d of %d, pid %d)", index + 1, worker, rank, world, pid)
    return event


def wait_for_new_step(
    follower: Follower, new_config: NewConfig, alive: Callable[[], bool], timeout_s: float, what: str,
) -> tuple[float, int]:
    """Block until a step of the new configuration exists; returns its (time, step). Raises ``RecoveryFailed`` if
    the job exits or ``timeout_s`` passes first."""
    started = time.monotonic()
    while True:
        found = [(record.time, record.step) for process in follower.processes() for record in process.steps
                 if new_config(process, record)]
        if found:
            return min(found)
        elapsed = time.monotonic() - started
        if not alive():
            raise RecoveryFailed(f"the job exited {elapsed:.1f} s after {what}, before any step of the new "
                                 f"configuration")
        if elapsed > timeout_s:
            raise RecoveryFailed(f"no step of the new configuration within {timeout_s:.0f} s of {what}")
        time.sleep(POLL_S)


def next_target(scenario: FaultScenario, rng: random.Random, base: int) -> int:
    """The step to wait for before the next kill: ``base`` + settle steps + a random 0…ckpt_every−1."""
    return base + scenario.settle_steps + rng.randrange(max(1, scenario.ckpt_every))


# ---------------------------------------------------------------------- torchrun elastic


def torchrun_command(scenario: FaultScenario, endpoint: str, job: str, train_args: list[str]) -> list[str]:
    """One agent, ``world`` workers, c10d rendezvous; a fixed node count (a range would make every restart wait
    ``last_call_timeout`` for nodes that never come)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={scenario.world}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
        f"--max-restarts={scenario.kills + 2}", "--monitor-interval=0.1", f"--local-addr={LOOPBACK}",
        "-m", "bench.train", *train_args,
    ]


def run_torchrun_faults(scenario: FaultScenario, out: Path, children: Children) -> FaultRun:
    out.mkdir(parents=True, exist_ok=True)
    job = f"bench-faults-{scenario.model}-{int(time.time())}"
    steps_dir, stop_file = out / "steps", out / "stop"
    train_args = [
        "--launcher", "torchrun", "--model", scenario.model, "--global-batch", str(scenario.global_batch),
        "--max-steps", str(10**7), "--steps-dir", str(steps_dir), "--label", "torchrun",
        "--accelerator", scenario.accelerator, "--ckpt-dir", str(out / "checkpoint"),
        "--ckpt-every", str(scenario.ckpt_every), "--stop-file", str(stop_file),
    ]
    command = torchrun_command(scenario, f"{LOOPBACK}:{free_port()}", job, train_args)
    env = bench_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "WARNING"})
    result = FaultRun("torchrun", scenario.model, time.time(), steps_dir, command)
    follower, rng = Follower(steps_dir), random.Random(scenario.seed)
    agent = children.start(command, env, out / "logs" / "agent.log")
    alive = lambda: agent.poll() is None  # noqa: E731
    events: list[KillEvent] = []
    try:
        round_start = float("-inf")
        target = next_target(scenario, rng, scenario.warmup_steps - scenario.settle_steps)
        for index in range(scenario.kills):
            follower.wait_for_step(target, scenario.timeout_s, alive, started_after=round_start)
            rank = 1 + index % (scenario.world - 1)
            victim = torchrun_worker(follower.processes(), rank, round_start)
            event = sigkill(victim.pid, f"rank {rank}", rank, scenario.world, index)
            events.append(event)
            what = f"the SIGKILL of rank {rank} (pid {victim.pid}, kill {index + 1})"
            _, step = wait_for_new_step(follower, started_after(event.killed_at), alive,
                                        scenario.recovery_timeout_s, what)
            round_start = event.killed_at
            target = next_target(scenario, rng, max(step, follower.max_step()))
        follower.wait_for_step(target, scenario.timeout_s, alive, started_after=round_start)
        write_stop_file(stop_file, follower.max_step() + stop_margin(follower, 5))
        code = agent.wait(scenario.timeout_s)
        if code:
            raise RecoveryFailed(f"the torchrun agent exited with {code} at the end (logs in {out / 'logs'})")
    except (RecoveryFailed, RuntimeError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc} (logs in {out / 'logs'})"
        log.error("torchrun %s: %s", scenario.model, result.error)
    finally:
        children.stop(agent)
        kill_strays(process.pid for process in follower.processes())
    result.kills = analyse_run("torchrun", load_steps(steps_dir), events)
    return result


def torchrun_worker(processes: Sequence[ProcessSteps], rank: int, round_start: float) -> ProcessSteps:
    """The live worker of ``rank`` (the ``RANK`` its step file names) started in the current round."""
    candidates = [p for p in processes if p.worker == str(rank) and p.start >= round_start and p.steps
                  and is_training_process(p.pid)]
    if not candidates:
        raise RuntimeError(f"no running torchrun worker of rank {rank} found in the step files")
    return max(candidates, key=lambda p: p.start)


# ---------------------------------------------------------------------- elan


def elan_run_options() -> set[str]:
    """The options this checkout's ``elan run`` accepts (read from its parser; no torch import)."""
    from lightning_elan.cli import build_parser

    return set(build_parser().commands["run"]._option_string_actions)


def run_elan_faults(scenario: FaultScenario, out: Path, children: Children) -> FaultRun:
    from bench.elan_runs import _am_address, elan_command
    from lightning_elan.protocol.client import AMClient

    out.mkdir(parents=True, exist_ok=True)
    job = f"bench-faults-{scenario.model}-{int(time.time())}"
    steps_dir, state_dir, home, stop_file = out / "steps", out / "state", out / "elan-home", out / "stop"
    options = ["--replace-failed"] if scenario.replace_failed else []
    command = elan_command(scenario.scenario(), job, state_dir, steps_dir, stop_file, scenario.coordinate_every,
                           max_steps=10**7, nproc=scenario.world, run_options=options)
    result = FaultRun("elan", scenario.model, time.time(), steps_dir, command)
    if scenario.replace_failed and "--replace-failed" not in elan_run_options():
        result.error = ("this checkout's `elan run` has no --replace-failed option (elan crash recovery has not "
                        "landed): nothing run. Pass --no-replace-failed to measure the planned removal and see the "
                        "first kill fail")
        log.error("elan %s: %s", scenario.model, result.error)
        return result
    proc = children.start(command, bench_env({"ELAN_HOME": str(home)}), out / "elan-run.log")
    follower, rng = Follower(steps_dir), random.Random(scenario.seed)
    alive = lambda: proc.poll() is None  # noqa: E731
    events: list[KillEvent] = []
    try:
        follower.wait_for_step(scenario.warmup_steps, scenario.timeout_s, alive, stall_s=STALL_S)
        client = AMClient(_am_address(job, home, scenario.timeout_s), job, timeout_s=5.0)
        try:
            result.planned_removals = planned_removals(scenario, client, follower, state_dir, alive)
            for index in range(scenario.kills):
                target = next_target(scenario, rng, follower.max_step())
                follower.wait_for_step(target, scenario.timeout_s, alive, stall_s=STALL_S)
                event = kill_elan_member(client, follower, scenario, index)
                events.append(event)
                what = f"the SIGKILL of {event.worker} (rank {event.rank}, pid {event.pid}, kill {index + 1})"
                dead_last = max((p.max_step for p in follower.processes() if p.pid == event.pid), default=-1)
                try:
                    recovered_at, _ = wait_for_new_step(follower, survivors_of(event, dead_last), alive,
                                                        scenario.recovery_timeout_s, what)
                except RecoveryFailed as exc:
                    code = proc.poll()
                    exited = "" if code is None else f"; elan run exited with {code}"
                    raise RecoveryFailed(f"{exc}{exited}: the elan job did not survive the loss of a worker (crash "
                                         f"recovery is needed for this measurement)") from exc
                restore_world(scenario, client, follower, event, recovered_at, alive)
        finally:
            client.close()
        write_stop_file(stop_file, follower.max_step() + stop_margin(follower, 5))
        code = proc.wait(scenario.timeout_s)
        if code:
            raise RecoveryFailed(f"elan run exited with {code} at the end")
    except (RecoveryFailed, RuntimeError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc} (log: {out / 'elan-run.log'})"
        log.error("elan %s: %s", scenario.model, result.error)
    finally:
        children.stop(proc)
        kill_strays(process.pid for process in follower.processes())
    result.kills = analyse_run("elan", load_steps(steps_dir), events)
    return result


def planned_removals(scenario: FaultScenario, client: Any, follower: Follower, state_dir: Path,
                     alive: Callable[[], bool]) -> list[dict[str, Any]]:
    """``planned_removals`` × (``remove 1``, settle, ``add 1``, settle); the removals' pauses (elan_runs'
    analysis). Done before any kill, so the AM's adjustment records are exactly these requests."""
    from bench.common import StallWatch
    from bench.elan_runs import _records, _scale, _wait_for_adjustment, analyse_elan

    requested: list[tuple[str, float]] = []
    records: list[dict[str, Any]] = []
    for _ in range(scenario.planned_removals):
        for action in ("remove", "add"):
            count = len(_records(state_dir)) + 1
            requested.append((action, _scale(client, action)))
            record = _wait_for_adjustment(state_dir, count, scenario.timeout_s, alive, StallWatch(follower, STALL_S))
            records.append(record)
            follower.wait_for_step(int(record["step"]) + scenario.settle_steps, scenario.timeout_s, alive,
                                   stall_s=STALL_S)
    adjustments = analyse_elan(load_steps(follower.steps_dir), records, requested)
    return [adjustment.as_dict() for adjustment in adjustments if adjustment.action == "remove"]


def kill_elan_member(client: Any, follower: Follower, scenario: FaultScenario, index: int) -> KillEvent:
    """SIGKILL a member of non-zero rank, found in ``elan status`` (its pid checked against the step files)."""
    members = client.status()["members"]
    if len(members) < 2:
        raise RuntimeError(f"only {len(members)} member(s): no non-zero rank to kill")
    rank = 1 + index % (len(members) - 1)
    member = next(m for m in members if m["rank"] == rank)
    pids = {p.pid for p in follower.processes() if p.worker == member["worker_id"]}
    pid = member.get("pid")
    if pid is None or pid not in pids:
        raise RuntimeError(f"member {member['worker_id']}: AM pid {pid} is not among its step files' {sorted(pids)}")
    return sigkill(int(pid), str(member["worker_id"]), rank, len(members), index)


def restore_world(scenario: FaultScenario, client: Any, follower: Follower, event: KillEvent, recovered_at: float,
                  alive: Callable[[], bool]) -> None:
    """Wait until the job trains at ``world`` workers again (a step after ``recovered_at``, the survivors' first
    one): the launcher's replacement (--replace-failed), or one the harness asks for."""
    from bench.elan_runs import _scale

    since = recovered_at
    if not scenario.replace_failed:
        since = _scale(client, "add")
    at_full = lambda process, record: record.time > since and record.world == scenario.world  # noqa: E731
    wait_for_new_step(follower, at_full, alive, scenario.timeout_s,
                      f"the SIGKILL of {event.worker} (waiting for the world size to be {scenario.world} again)")


# ---------------------------------------------------------------------- both, for bench.run and the CLI


def run_faults(scenario: FaultScenario, launchers: Sequence[str], out: Path, children: Children) -> dict[str, Any]:
    """Each launcher's run for one model: ``{launcher: FaultRun.as_dict()}`` (a failed run carries ``error``)."""
    runs = {"torchrun": run_torchrun_faults, "elan": run_elan_faults}
    results = {}
    for launcher in launchers:
        log.info("[%s] %s: %d kills under %s", scenario.accelerator, scenario.model, scenario.kills, launcher)
        results[launcher] = runs[launcher](scenario, out / launcher, children).as_dict()
    return results


def recovery_values(run: dict[str, Any] | None, key: str) -> list[float]:
    """Finite values of ``key`` over a run's kills."""
    if not run:
        return []
    values = [kill.get(key) for kill in run.get("kills", [])]
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1m,25m", help=f"comma-separated, of {', '.join(MODEL_SIZES)}")
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs per model and launcher")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="torchrun and/or elan")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="faults.json and faults.md")
    parser.add_argument("--work-dir", type=Path, default=None, help="step files and logs (default: a temp dir, kept)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--planned-removals", type=int, default=2, help="elan: remove 1 / add 1 cycles")
    parser.add_argument("--replace-failed", action=argparse.BooleanOptionalAction, default=True,
                        help="elan: start the job with `elan run --replace-failed` (else the harness adds a worker)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="torchrun: checkpoint interval in steps")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def scenario_for(args: argparse.Namespace, model: str, accelerator: str) -> FaultScenario:
    """A model's settings from bench.faults' options or bench.run's (there prefixed ``fault_``); an option the
    command does not have keeps the default."""
    names = ("kills", "warmup_steps", "settle_steps", "planned_removals", "replace_failed", "ckpt_every", "seed")
    settings = {}
    for name in names:
        value = getattr(args, f"fault_{name}", getattr(args, name, None))
        if value is not None:
            settings[name] = value
    return FaultScenario(model, accelerator=accelerator, **settings)


def main(argv: list[str] | None = None) -> int:
    """Run the fault benchmark alone; 1 if any run failed (its error is in faults.json/.md)."""
    from bench.report import faults_markdown
    from bench.run import environment

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-faults-"))
    args.out.mkdir(parents=True, exist_ok=True)
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = set(launchers) - set(LAUNCHERS)
    if unknown:
        raise SystemExit(f"unknown launcher(s) {sorted(unknown)}: use {', '.join(LAUNCHERS)}")
    results: dict[str, Any] = {"environment": environment(), "arguments": {k: str(v) for k, v in vars(args).items()},
                               "command": " ".join(["python -m bench.faults", *(argv or sys.argv[1:])]),
                               "devices": {args.device: {"models": {}}}}
    models = results["devices"][args.device]["models"]
    children = Children()
    started = time.monotonic()

    def save() -> None:
        results["environment"]["loadavg_end"] = os.getloadavg()
        results["environment"]["wall_s"] = time.monotonic() - started
        (args.out / "faults.json").write_text(json.dumps(results, indent=1))
        (args.out / "faults.md").write_text(faults_markdown(results))

    log.info("work dir %s; results to %s", work, args.out / "faults.json")
    try:
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            scenario = scenario_for(args, model, args.device)
            models[model] = {"parameters": MODEL_SIZES[model].parameters(),
                             "faults": run_faults(scenario, launchers, work / args.device / model, children)}
            save()
    finally:
        children.stop_all()
        save()
    failed = [f"{model}/{name}" for model, entry in models.items() for name, run in entry["faults"].items()
              if run.get("error")]
    if failed:
        log.error("failed: %s (see faults.md)", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
