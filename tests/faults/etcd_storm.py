"""Seeded failure storms on an etcd-store job with a standby AM: ``python -m tests.faults.etcd_storm --storms N
--seed S``.

The job is the one of ``tests/faults/storm.py`` (the same probe, 98 float64 steps, global batch 18) run as a job of
``elan worker``s under two ``elan am --store etcd://… --lease-ttl 2 --min-workers 2 --max-workers 3`` processes (one
leads, one stands by: ``StandbyCluster`` of tests/integration/test_standby_job.py, on a throw-away etcd). Three
workers form generation 0; every 1.5–4 s one random event hits it:

- ``kill_am``: SIGKILL of the *leading* AM (the one ``status`` names); the driver then starts that AM again at its
  address, as systemd would, so a standby exists again;
- ``kill_worker``: SIGKILL of a worker's training process (the crash of a member or a joiner; its ``elan worker``
  reports the death and announces it to the survivors). SIGKILL of the ``elan worker`` itself would only SIGTERM its
  child (a parent-death signal): a graceful leave, the same as ``term_worker``;
- ``term_worker``: SIGTERM of an ``elan worker`` (a scheduler deleting the pod): it passes the signal on, the worker
  leaves;
- ``grow``: a new ``elan worker`` started by the driver (a job of ``elan worker``s grows that way: the AM refuses
  ``elan scale add`` without an autoscale ``scale_out_command``); it is also the only replacement of a lost worker;
- ``remove``: ``elan scale remove 1``.

Nothing waits for an earlier event to settle. No event may take a member while fewer than ``SPARED_MEMBERS`` + 1
would be left (the driver's view of the membership lags). A storm *held* when the job's stored state says its
training completed, every AM exited 0, every ``elan worker`` the driver did not signal exited 0 (a grown one refused
because the job was full or over: 3; one still enrolling once every AM had gone is SIGTERMed) and the result is the
static run's (``tests/faults/checks.py``). A SIGTERMed worker counts like a killed one (``elan run`` recovers either
the same way): its exit is noted, not judged. A grown joiner the job finished without (pending when the members
trained out) exits 1 when no AM is left to answer its ``register``: allowed, and noted too. Prints one line per
storm and ``held: H of N storms``; exit 0 only if all held.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lightning_elan.etcd import parse_etcd_url
from lightning_elan.launcher.enrolled import EXIT_NOT_ENROLLED
from lightning_elan.master.etcd_store import EtcdStore
from lightning_elan.master.main import CLEAN_FINISHES
from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from tests import processes
from tests.faults.checks import StormCheck, check_storm
from tests.faults.storm import (
    EPOCHS,
    GAP_S,
    JOB_TIMEOUT_S,
    SAMPLES,
    SPARED_MEMBERS,
    STORM_ARGS,
    WORKERS,
    _send,
    _worker_id,
    run_static,
)
from tests.integration.elastic_runs import RunResult
from tests.integration.etcd_server import EtcdServer
from tests.integration.test_standby_job import JOB, StandbyCluster

EVENTS = ("kill_worker", "term_worker", "kill_am", "grow", "remove")
MAX_WORKERS = 3  # the AMs' --max-workers
END_GRACE_S = 150.0
"""How long a process may take to end once the job is over (a joiner the job ended without gives up on its AM after
6 × 5 s, then on reporting its exit after 31 × 1 s)."""


@dataclass
class EtcdStorm:
    """One storm's job and what was done to it."""

    seed: int
    directory: Path
    events: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # exits allowed but not 0 (SIGTERMed, late joiners)
    verdict: str = ""  # why the processes did not end as they should ("" when they did)
    run: RunResult | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"etcd-storm{self.seed}"


class StormCluster(StandbyCluster):
    """``StandbyCluster`` running the storm's probe job, restarting AMs under fresh log names."""

    def __init__(self, tmp: Path, etcd: EtcdServer) -> None:
        super().__init__(tmp, etcd)
        self.restarts = 0

    def storm_worker(self, name: str) -> subprocess.Popen:
        return self.worker(name, *STORM_ARGS)  # the probe's last value of each option wins: the storm job's

    def restart_am(self, index: int) -> subprocess.Popen:
        """Start AM ``index`` again at its address; the killed incarnation's log is kept as ``am<i>.<n>.log``."""
        self.restarts += 1
        log = self.tmp / f"am{index}.log"
        if log.exists():
            log.rename(self.tmp / f"am{index}.{self.restarts}.log")
        return self.am(index, start_grace=10.0)

    def ams(self) -> dict[int, subprocess.Popen]:
        return {index: self.procs[f"am{index}"] for index in (0, 1) if f"am{index}" in self.procs}

    def workers(self) -> dict[str, subprocess.Popen]:
        return {name: proc for name, proc in self.procs.items() if not name.startswith("am")}


def run_etcd_storm(root: Path, seed: int) -> EtcdStorm:
    """Run one storm on its own etcd to its end; the files stay under ``root/etcd-storm<seed>``."""
    storm = EtcdStorm(seed, root / f"etcd-storm{seed}")
    storm.directory.mkdir(parents=True, exist_ok=True)
    with EtcdServer(storm.directory / "etcd") as etcd:
        cluster = StormCluster(storm.directory, etcd)
        try:
            _start(cluster)
            weather = _Weather(storm, cluster, random.Random(seed))
            weather.blow()
            weather.strand()
            returncode, verdict = _verdict(cluster, weather, storm.notes)
        except Exception as error:  # recorded: the storm did not hold
            storm.error = f"{type(error).__name__}: {error}"
            returncode, verdict = 1, storm.error
        finally:
            cluster.stop()
    (storm.directory / "verdict.txt").write_text(f"{verdict}\n{'; '.join(storm.notes)}\n")
    storm.verdict = verdict
    output = f"{cluster.logs()}\n--- verdict\n{verdict}"
    storm.run = RunResult(cluster.out, cluster.state_dir, returncode, output)
    return storm


def _start(cluster: StormCluster) -> None:
    """Both AMs (the first leads), then the three workers of generation 0 (the AMs start the job at three)."""
    am0_log, am1_log = cluster.tmp / "am0.log", cluster.tmp / "am1.log"
    cluster.am(0, start_grace=10.0)
    cluster.wait_until(lambda: "serving on" in am0_log.read_text(), "the first AM leading", 60)
    cluster.am(1, start_grace=10.0)
    cluster.wait_until(lambda: "standing by" in am1_log.read_text(), "the second AM standing by", 60)
    for index in range(WORKERS):
        cluster.storm_worker(f"w{index}")


class _Weather:
    """Sends one storm's random events to its job until every worker has exited."""

    def __init__(self, storm: EtcdStorm, cluster: StormCluster, rng: random.Random) -> None:
        self.storm, self.cluster, self.rng = storm, cluster, rng
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.signalled: set[int] = set()  # elan worker pids whose worker was killed or SIGTERMed
        self.killed_children: set[int] = set()  # elan worker pids whose training process was SIGKILLed
        self.grown: set[int] = set()  # elan worker pids the driver started after generation 0
        self.stranded: set[int] = set()  # grown elan worker pids still enrolling once the job was over

    def blow(self) -> None:
        while self._sleep(self.rng.uniform(*GAP_S)):
            event = self.rng.choice(EVENTS)
            done = getattr(self, f"_{event}")()
            self.storm.events.append(event if done else f"({event})")

    def _live_workers(self) -> dict[int, subprocess.Popen]:
        return {proc.pid: proc for proc in self.cluster.workers().values() if proc.poll() is None}

    def _kill_worker(self) -> bool:
        return self._signal_worker(signal.SIGKILL)

    def _term_worker(self) -> bool:
        return self._signal_worker(signal.SIGTERM)

    def _signal_worker(self, sig: signal.Signals) -> bool:
        """SIGKILL a worker's training process or SIGTERM its ``elan worker`` — but leave ``SPARED_MEMBERS``
        members that are neither signalled nor due to be removed."""
        children = {pid: _training_pid(pid) for pid in self._live_workers() if pid not in self.signalled}
        workers = {pid: _worker_id(child) if child else None for pid, child in children.items()}
        members, removals = self._membership()
        if members is None:
            return False  # no AM answers (a fail-over): who is a member is unknown
        safe = [pid for pid, worker in workers.items() if worker in members]
        victims = [pid for pid, worker in workers.items() if worker is not None]
        if len(safe) - removals < SPARED_MEMBERS + 1:
            victims = [pid for pid in victims if pid not in safe]
        if not victims:
            return False
        pid = self.rng.choice(victims)
        self.signalled.add(pid)
        if sig == signal.SIGTERM:
            return _send(pid, sig)
        self.killed_children.add(pid)
        child = children[pid]
        return child is not None and _send(child, sig)

    def _membership(self) -> tuple[set[str] | None, int]:
        """The current members and the removals asked for but not yet applied, from the leading AM's status."""
        status = self._status()
        if status is None:
            return None, 0
        members = {member["worker_id"] for member in status.get("members") or []}
        requests = [*(status.get("pending") or []), *([status["in_flight"]] if status.get("in_flight") else [])]
        removals = sum(1 for request in requests if request.get("action") in ("remove", "migrate"))
        return members, removals

    def _status(self) -> dict | None:
        try:
            with AMClient(self.cluster.am_list, JOB, timeout_s=0.5, retries=0) as client:
                return client.status()
        except (AMUnavailable, AMError, OSError, ValueError):
            return None

    def _kill_am(self) -> bool:
        """SIGKILL the AM that leads (the one ``status`` answers from), then start it again: a standby again."""
        status = self._status()
        pid = (status or {}).get("am", {}).get("pid")
        leading = [index for index, proc in self.cluster.ams().items() if proc.pid == pid and proc.poll() is None]
        if not leading:
            return False
        proc = self.cluster.ams()[leading[0]]
        done = _send(proc.pid, signal.SIGKILL)
        proc.wait()
        self.cluster.restart_am(leading[0])
        return done

    def _grow(self) -> bool:
        """A new ``elan worker``; the AM takes it as a joiner while the job has fewer than ``MAX_WORKERS``."""
        live = [pid for pid in self._live_workers() if pid not in self.signalled]
        if len(live) >= MAX_WORKERS:
            return False
        proc = self.cluster.storm_worker(f"w{len(self.cluster.workers())}")
        self.grown.add(proc.pid)
        return True

    def _remove(self) -> bool:
        members, removals = self._membership()
        live = {_worker_id(child) for pid in self._live_workers() if pid not in self.signalled
                for child in [_training_pid(pid)] if child}
        if members is None or len(members & live) - removals < SPARED_MEMBERS + 1:
            return False
        proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "scale", "--job", JOB, "--am",
                               self.cluster.am_list, "remove", "1"], env=self.cluster.env, capture_output=True,
                              text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.returncode == 0  # a refusal (an adjustment in flight, a fail-over) is an answer too: not sent

    def _sleep(self, seconds: float) -> bool:
        """Sleep; False once the job is over: every worker exited, or every AM (an AM exits when the job is over;
        the driver restarts the ones it kills at once)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self._going_on():
                return False
            assert time.monotonic() < self.deadline, f"storm ran past {JOB_TIMEOUT_S} s"
            time.sleep(0.05)
        return self._going_on()

    def _going_on(self) -> bool:
        return bool(self._live_workers()) and any(proc.poll() is None for proc in self.cluster.ams().values())

    def strand(self) -> None:
        """After the job: SIGTERM the ``elan worker``s still enrolling with no AM left (started too late)."""
        for pid, proc in self._live_workers().items():
            if pid in self.grown and _training_pid(pid) is None:
                self.stranded.add(pid)
                proc.terminate()


def _training_pid(worker_pid: int) -> int | None:
    """The training process an ``elan worker`` runs (the probe), if it runs one."""
    for pid in processes.launched_by(worker_pid):
        argv = processes.argv(pid)
        if argv and any(arg.endswith(b"probe_train.py") for arg in argv):
            return pid
    return None


def _verdict(cluster: StormCluster, weather: _Weather, notes: list[str]) -> tuple[int, str]:
    """0 and "" when the stored state says the training completed and every process ended as it should; else 1 and
    why not. Exits allowed but worth knowing are added to ``notes``."""
    problems = _am_problems(cluster) + _state_problems(cluster.store)
    for name, proc in cluster.workers().items():
        problem, note = _worker_exit(cluster, weather, name, proc.pid, proc.wait(END_GRACE_S))
        problems += [problem] if problem else []
        notes += [note] if note else []
    refused = sum(1 for proc in cluster.workers().values() if proc.pid in weather.grown
                  and proc.returncode == EXIT_NOT_ENROLLED)
    if refused:
        notes.append(f"{refused} grown worker(s) refused (the job full, or over)")
    return (1 if problems else 0), "; ".join(problems)


def _worker_exit(cluster: StormCluster, weather: _Weather, name: str, pid: int, code: int) -> tuple[str | None,
                                                                                                   str | None]:
    """``(problem, note)`` about an ``elan worker``'s exit: a problem when it is wrong, a note when it is allowed
    but not 0. A SIGTERMed worker is like a killed one for the job (``elan run`` recovers either the same way): its
    exit is noted, not judged."""
    if code == 0 or pid in weather.killed_children:
        return None, None
    if pid in weather.grown and (code == EXIT_NOT_ENROLLED or pid in weather.stranded):
        return None, None  # refused (the job full or over), or started after the job was over
    text = (cluster.tmp / f"{name}.log").read_text()
    worker = re.search(r"enrolled in job \S+ as (w\d+)", text)
    who = f"{name} ({worker[1] if worker else '?'}) exited {code}"
    trained = worker is not None and (cluster.out / f"training-{worker[1]}.jsonl").exists()
    if pid in weather.grown and not trained and "AMUnavailable" in text:
        return None, f"late joiner {who}: the job finished before it joined, no AM answered its register"
    if pid in weather.signalled:
        return None, f"SIGTERMed {who}: {_sigterm_end(text)}"
    return f"elan worker {who}", None


def _sigterm_end(text: str) -> str:
    """How a SIGTERMed worker that did not exit 0 ended, from its log."""
    if "has held a SIGTERM for" in text:
        return "still starting after --term-grace, SIGKILLed by its elan worker (a failure, recovered)"
    if "the job is finished or shutting down" in text:
        return "a joiner the job finished without: its leave took the crash path"
    if "does not answer worker" in text and "has not left the job 30 s after SIGTERM" in text:
        return "a joiner the job finished without: no AM left to answer its leave, the crash path after 30 s"
    return "see its log"


def _am_problems(cluster: StormCluster) -> list[str]:
    problems = []
    for index, proc in cluster.ams().items():
        try:
            code = proc.wait(END_GRACE_S)
        except subprocess.TimeoutExpired:
            problems.append(f"am{index} (pid {proc.pid}) still running {END_GRACE_S:.0f} s after the job")
            continue
        if code != 0:
            problems.append(f"am{index} (pid {proc.pid}) exited {code}")
    return problems


def _state_problems(store: str) -> list[str]:
    """The job's stored state (etcd) must say the training completed."""
    document = EtcdStore(parse_etcd_url(store), JOB, retry_s=0.5).load() or {}
    state = document.get("state", {})
    if state.get("finished") and state.get("finish_reason") in CLEAN_FINISHES and not state.get("failed_reason"):
        return []
    return [f"stored state: finished {state.get('finished')}, reason {state.get('finish_reason')!r}, failed "
            f"{state.get('failed_reason')!r}"]


def check(storm: EtcdStorm, static: RunResult) -> StormCheck:
    """The storm's invariants (raises AssertionError naming the first that failed)."""
    assert storm.error is None, storm.error
    assert storm.run is not None
    assert storm.run.returncode == 0, storm.verdict
    return check_storm(storm.run, static, SAMPLES, EPOCHS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storms", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1, help="storm i uses seed S + i")
    parser.add_argument("--dir", type=Path, default=None, help="keep the jobs' files here (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files of storms that held too")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop etcd and the job too
    root = args.dir or Path(tempfile.mkdtemp(prefix="elan-etcd-storms-"))
    print(f"files in {root}", flush=True)
    static = run_static(root / "static")
    held, failed = 0, []
    for seed in range(args.seed, args.seed + args.storms):
        ok = _one(root, seed, static, args.keep)
        held += ok
        failed += [] if ok else [seed]
    print(f"held: {held} of {args.storms} storms" + (f"; failed seeds: {failed}" if failed else ""), flush=True)
    return 0 if held == args.storms else 1


def _one(root: Path, seed: int, static: RunResult, keep: bool) -> bool:
    started = time.monotonic()
    storm = run_etcd_storm(root, seed)
    try:
        result = check(storm, static)
        ok, detail = True, f"held ({result})"
    except AssertionError as error:
        ok, detail = False, f"FAILED: {str(error)[:600]}"
        traceback.print_exc(file=sys.stderr)
    events = Counter(e for e in storm.events if not e.startswith("("))
    notes = f" [{'; '.join(storm.notes)}]" if storm.notes else ""
    print(f"etcd storm seed {seed}: {dict(events)} in {time.monotonic() - started:.0f} s: {detail}{notes}",
          flush=True)
    if ok and not keep:
        subprocess.run(["rm", "-rf", str(storm.directory)], check=False)
    return ok


if __name__ == "__main__":
    sys.exit(main())
