"""Seeded failure storms: ``python -m tests.faults.storm --storms N --seed S [--strategy STRATEGY]``.

One storm is one 3-worker float64 probe job (``--loader-workers N``: its DataLoaders with N worker processes;
``strategy="elan"``, or ``"elan_fsdp"``: the model sharded by FSDP2, or
``"elan_fsdp_units"``: each Linear its own unit, so a death cuts forwards between units, or ``"elan_hsdp"``:
``ElanFSDPStrategy(hsdp_group_size=2)``, HSDP whenever the job has 4 members)
under ``elan run --replace-failed --coordinate-every 1`` (98 steps) that receives a random event every 1.5–4 s until it
ends: SIGKILL of a worker, SIGTERM of a worker, SIGKILL of the AM, ``elan scale add 1``, ``elan scale remove 1``.
Events are real signals to real processes and real CLI requests; nothing waits for an earlier event to settle, so
adjustments, recoveries and AM restarts overlap.

A storm *held* when the job exited 0 and its result is the static run's: the same last step, every sample trained
exactly once per epoch, the members bit-identical at every step (under ``elan_fsdp`` the members hold different
shards: the full state they gather at the end is checked instead), the final parameters and optimizer state within
1e-9 of a static 3-worker run of the same strategy. Prints one line per storm and ``held: H of N storms``; exit 0 only
if all held.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from tests import processes
from tests.faults.checks import StormCheck, check_storm
from tests.integration.elastic_runs import PROBE, RunResult, elan_env

WORKERS = 3
SAMPLES, EPOCHS, BATCH, GLOBAL_BATCH = 240, 7, 6, 18  # 14 steps per epoch, 98 steps
STORM_ARGS = ["--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
              "--global-batch", str(GLOBAL_BATCH), "--step-sleep", "0.1", "--progress"]
STRATEGIES = ("elan", "elan_fsdp", "elan_fsdp_units", "elan_hsdp")
EVENTS = ("kill_worker", "term_worker", "kill_am", "add", "remove")
GAP_S = (1.5, 4.0)
JOB_TIMEOUT_S = 900.0
MAX_WORKERS = 5
SPARED_MEMBERS = 2
"""Members no event may take: with no member left there is no state to go on from, and the driver's view of the
membership (the AM's status) lags a leaver's exit, so one more than the minimum is kept."""


@dataclass
class Storm:
    """One storm's job and what was done to it."""

    seed: int
    directory: Path
    events: list[str] = field(default_factory=list)
    run: RunResult | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"storm{self.seed}"


def job_command(directory: Path, name: str, nproc: int, extra: tuple[str, ...] = (),
                probe_args: list[str] = STORM_ARGS) -> list[str]:
    return [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
            "--coordinate-every", "1", "--state-dir", str(directory / f"{name}-state"), *extra,
            "--", sys.executable, str(PROBE), "--out", str(directory / name), *probe_args]


def storm_args(strategy: str = "elan", loader_workers: int = 0) -> list[str]:
    """The probe's options of a storm job of ``strategy`` whose DataLoaders have ``loader_workers`` processes."""
    return [*STORM_ARGS, "--strategy", strategy, "--num-workers", str(loader_workers)]


def run_static(directory: Path, probe_args: list[str] = STORM_ARGS) -> RunResult:
    """The static 3-worker run every storm is compared with."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(job_command(directory, "static", WORKERS, probe_args=probe_args), env=elan_env(directory),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    (directory / "static.log").write_text(output)
    run = RunResult(directory / "static", directory / "static-state", proc.returncode, output)
    assert run.returncode == 0, run.excerpt()
    return run


def run_storm(root: Path, seed: int, launcher_args: tuple[str, ...] = (), probe_args: list[str] = STORM_ARGS) -> Storm:
    """Run one storm to its end; the job's files stay under ``root/storm<seed>``."""
    storm = Storm(seed, root / f"storm{seed}")
    storm.directory.mkdir(parents=True, exist_ok=True)
    env = elan_env(storm.directory)
    log_path = storm.directory / f"{storm.name}.log"
    command = job_command(storm.directory, storm.name, WORKERS, ("--replace-failed", *launcher_args), probe_args)
    with open(log_path, "w") as log_file:
        launcher = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        try:
            _Weather(storm, env, launcher, random.Random(seed)).blow()
            launcher.wait(JOB_TIMEOUT_S)
        except Exception as error:  # recorded: the storm did not hold
            storm.error = f"{type(error).__name__}: {error}"
        finally:
            _stop(launcher)
    storm.run = RunResult(storm.directory / storm.name, storm.directory / f"{storm.name}-state", launcher.returncode,
                          log_path.read_text())
    return storm


def _stop(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


class _Weather:
    """Sends one storm's random events to its job until the job ends."""

    def __init__(self, storm: Storm, env: dict[str, str], launcher: subprocess.Popen, rng: random.Random) -> None:
        self.storm, self.env, self.launcher, self.rng = storm, env, launcher, rng
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.signalled: set[int] = set()

    def blow(self) -> None:
        while self._sleep(self.rng.uniform(*GAP_S)):
            event = self.rng.choice(EVENTS)
            done = getattr(self, f"_{event}")()
            self.storm.events.append(event if done else f"({event})")

    def _kill_worker(self) -> bool:
        return self._signal_worker(signal.SIGKILL)

    def _term_worker(self) -> bool:
        return self._signal_worker(signal.SIGTERM)

    def _signal_worker(self, sig: signal.Signals) -> bool:
        """Signal a random worker process (a member, a joiner warming up, a replacement) — but leave the job
        ``SPARED_MEMBERS`` members that are neither signalled nor due to be removed. SIGTERM goes to its DataLoader
        processes too, at once, as ``scancel`` or a machine's shutdown sends it to every process."""
        spawned = spawned_workers(self.storm.directory / f"{self.storm.name}.log")
        workers = {pid: spawned.get(pid) or _worker_id(pid) for pid in self._children("worker")
                   if pid not in self.signalled}
        members, removals = self._membership()
        if members is None:
            return False  # the AM does not answer (restarting): who is a member is unknown
        safe = [pid for pid, worker in workers.items() if worker in members]
        victims = [pid for pid, worker in workers.items() if worker is not None]
        if len(safe) - removals < SPARED_MEMBERS + 1:
            victims = [pid for pid in victims if pid not in safe]
        if not victims:
            return False
        pid = self.rng.choice(victims)
        self.signalled.add(pid)
        tree = processes.children(pid) if sig == signal.SIGTERM else []  # its DataLoader processes (--loader-workers)
        return all([processes.send(signalled, sig) for signalled in (pid, *tree)])

    def _membership(self) -> tuple[set[str] | None, int]:
        """The current members and the removals asked for but not yet applied, from the AM's status."""
        try:
            with AMClient(self._address(), self.storm.name, timeout_s=0.5, retries=0) as client:
                status = client.status()
        except (AMUnavailable, AMError, OSError, ValueError):
            return None, 0
        members = {member["worker_id"] for member in status.get("members") or []}
        requests = [*(status.get("pending") or []), *([status["in_flight"]] if status.get("in_flight") else [])]
        removals = sum(1 for request in requests if request.get("action") in ("remove", "migrate"))
        return members, removals

    def _address(self) -> str:
        registry = Path(self.env["ELAN_HOME"]) / "jobs" / f"{self.storm.name}.json"
        return json.loads(registry.read_text())["address"]

    def _kill_am(self) -> bool:
        ams = self._children("am")
        return bool(ams) and processes.send(ams[0], signal.SIGKILL)

    def _add(self) -> bool:
        if len(self._children("worker")) >= MAX_WORKERS:
            return False
        return self._scale("add", "1")

    def _remove(self) -> bool:
        if len([p for p in self._children("worker") if p not in self.signalled]) <= 1:
            return False
        return self._scale("remove", "1")

    def _scale(self, *request: str) -> bool:
        """``elan scale``; a refusal (an adjustment in flight, the AM restarting) is an answer too: not sent."""
        proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "scale", "--job", self.storm.name,
                               *request], env=self.env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.returncode == 0

    def _children(self, kind: str) -> list[int]:
        """Live children of the launcher: its workers (``worker``) or its AM (``am``)."""
        return [pid for pid in processes.launched_by(self.launcher.pid) if _kind(processes.argv(pid)) == kind]

    def _sleep(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.launcher.poll() is not None:
                return False
            assert time.monotonic() < self.deadline, f"storm ran past {JOB_TIMEOUT_S} s"
            time.sleep(0.02)
        return self.launcher.poll() is None


def spawned_workers(log_path: Path) -> dict[int, str]:
    """``{pid: worker id}`` from ``elan run``'s log (a preloaded worker's ``/proc/PID/environ`` is the launcher's)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    return {pid: worker for worker, pid in processes.spawned_workers(text).items()}


def _worker_id(pid: int) -> str | None:
    """The ``ELAN_WORKER_ID`` a worker process was started with (not a preloaded one: see :func:`spawned_workers`)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"ELAN_WORKER_ID="):
            return entry.split(b"=", 1)[1].decode()
    return None


def _kind(argv: list[bytes] | None) -> str | None:
    """``worker`` for the probe script, ``am`` for ``elan am``, else None."""
    if argv is None:
        return None
    if any(arg.endswith(b"probe_train.py") for arg in argv):
        return "worker"
    cli = argv.index(b"lightning_elan.cli") if b"lightning_elan.cli" in argv else -1
    return "am" if cli >= 0 and argv[cli + 1 : cli + 2] == [b"am"] else None


def check(storm: Storm, static: RunResult, strategy: str = "elan") -> StormCheck:
    """The storm's invariants (raises AssertionError naming the first that failed)."""
    assert storm.error is None, storm.error
    assert storm.run is not None
    return check_storm(storm.run, static, SAMPLES, EPOCHS, sharded=strategy != "elan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storms", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1, help="storm i uses seed S + i")
    parser.add_argument("--dir", type=Path, default=None, help="keep the jobs' files here (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files of storms that held too")
    parser.add_argument("--strategy", choices=STRATEGIES, default="elan", help="the storm jobs' strategy")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="DataLoader worker processes per worker (a SIGTERM event signals them too)")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="elan-storms-"))
    print(f"files in {root}", flush=True)
    probe_args = storm_args(args.strategy, args.loader_workers)
    static = run_static(root / "static", probe_args)
    held, failed = 0, []
    for seed in range(args.seed, args.seed + args.storms):
        ok = _one(root, seed, static, args.keep, args.strategy, probe_args)
        held += ok
        failed += [] if ok else [seed]
    print(f"held: {held} of {args.storms} storms" + (f"; failed seeds: {failed}" if failed else ""), flush=True)
    return 0 if held == args.storms else 1


def _one(root: Path, seed: int, static: RunResult, keep: bool, strategy: str, probe_args: list[str]) -> bool:
    started = time.monotonic()
    storm = run_storm(root, seed, probe_args=probe_args)
    try:
        result = check(storm, static, strategy)
        ok, detail = True, f"held ({result})"
    except AssertionError as error:
        ok, detail = False, f"FAILED: {str(error)[:600]}"
        traceback.print_exc(file=sys.stderr)
    events = Counter(e for e in storm.events if not e.startswith("("))
    print(f"storm seed {seed}: {dict(events)} in {time.monotonic() - started:.0f} s: {detail}", flush=True)
    if ok and not keep:
        subprocess.run(["rm", "-rf", str(storm.directory)], check=False)
    return ok


if __name__ == "__main__":
    sys.exit(main())
