"""AM-crash trials: a real probe job under `elan run` with a dense schedule, its AM process SIGKILLed at seeded random
moments; every job must still end with the exact static result (``check_elastic_run``).

A *trial* is one SIGKILL of the AM. Each job carries several, each aimed at a phase of the job:

* ``start``     — a random moment in the first second after the AM registered: the launcher is sending
                  ``start_job`` and the schedule's ``scale`` requests, members register;
* ``scale``     — right after the test itself sent a ``scale`` request (an extra ``add 1``), before or after the AM
                  persisted it: the request is resent with the same id and must apply exactly once;
* ``waiting``   — while a joiner that reported ready waits (its ``wait_plan`` parked in the AM);
* ``in_flight`` — while an adjustment is in flight (decided, the new generation not yet heard from);
* ``random``    — a random moment up to 2 s after the previous AM came back.

Except ``start``, each kill first waits for a seeded random training step (increasing over the job), so the kills
spread over every generation of the schedule.

Besides, the AM kills itself (a real SIGKILL, ``am_save_kill/sitecustomize.py``) right *before* or right *after* a
seeded write of its state: the two windows that matter for exactly-once (received but not persisted; persisted but
not answered). These count as trials ``save_before`` / ``save_after``.

The kill is a real ``os.kill(pid, SIGKILL)`` of the AM process named in the job registry (checked to be an ``elan
am`` process). A phase the job never reaches again (it finished first) is not counted as a trial.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE_ARGS,
    SAMPLES,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_each_sample_once,
    assert_ranks_agree,
    assert_states_close,
    check_adjustment_steps,
    check_elastic_run,
    elan_command,
    elan_env,
    epoch_ends,
)

# 2 → 3 → 2 → 2 (migrate) → 3 → 2 (rank 0 leaves) → 2 (migrate); epochs end at steps 9, 18, 27
SCHEDULE = "2:add=1,5:remove=1,8:migrate=1,12:add=1,15:remove=rank:0,20:migrate=1"
SIZES = [3, 2, 2, 3, 2, 2]
EXTRA = "23:add=1"  # the test's own scale request (phase ``scale``)
EXTRA_BODY = {"action": "add", "count": 1, "at_step": 23}
EXTRA_LATEST_STEP = 17  # sent no later than this step, so that it lands before the job ends
PHASES = ("start", "scale", "waiting", "in_flight", "random")
KILL_ARGS = [*PROBE_ARGS, "--wait-for-joiners", "--step-sleep", "0.3"]
JOB_TIMEOUT_S = 400.0
SAVE_KILL_SITE = Path(__file__).with_name("am_save_kill")
LAST_SAVE_KILL = 45  # a job writes its state some 60+ times
AM_BACK_TIMEOUT_S = 30.0


def kill_phases(seed: int, count: int) -> list[str]:
    """``count`` phases for one job: ``start`` first, then a seeded shuffle of the others (repeated as needed)."""
    rng = random.Random(seed)
    rest: list[str] = []
    while len(rest) < count - 1:
        batch = list(PHASES[1:])
        rng.shuffle(batch)
        rest += batch
    return ["start", *rest][:count]


@dataclass
class KillJob:
    """What one job under AM kills did; ``held`` once :meth:`check` passed."""

    name: str
    seed: int
    planned: list[str]
    delivered: list[str] = field(default_factory=list)
    extra_sent: bool = False
    run: RunResult | None = None
    error: str | None = None

    @property
    def schedule(self) -> str:
        return f"{SCHEDULE},{EXTRA}" if self.extra_sent else SCHEDULE

    @property
    def sizes(self) -> list[int]:
        return [*SIZES, SIZES[-1] + 1] if self.extra_sent else SIZES

    def check(self, static: RunResult) -> int:
        """The job's exact-result invariants, and one AM death logged per delivered kill; returns how many requests
        of the schedule were applied.

        A ``coordinate`` the AM does not answer means "no decision, ask again in 5 s" (the workers' AM link): a kill
        just before the last scheduled steps can let training end first. The requests applied must then be a prefix
        of the schedule (FIFO), the others cancelled at shutdown; every other invariant is checked in full."""
        assert self.run is not None and self.error is None, f"{self.error}\n{self.run.excerpt() if self.run else ''}"
        adjustments = self.run.adjustments()
        applied = len(adjustments)
        items = self.schedule.split(",")
        assert 0 < applied <= len(items), (
            f"{applied} adjustments for {len(items)} requests: "
            f"{[(a.get('request_id'), a.get('action'), a.get('step'), a.get('members')) for a in adjustments]}\n"
            + "\n".join(line for line in self.run.output.splitlines() if line.startswith("elan:")))
        if applied == len(items):
            check_elastic_run(self.run, static, self.schedule, self.sizes)
        else:
            _check_schedule_prefix(self.run, static, ",".join(items[:applied]), self.sizes[:applied])
        restarts = self.run.output.count("restarting it from its store")
        # a kill after the launcher's last request to the AM needs no restart: the launcher just reaps it at the end
        at_end = len(re.findall(r"^elan: the AM of job \S+ \(pid \d+\) was killed by SIGKILL$", self.run.output, re.M))
        kills = len(self.delivered)
        assert restarts + at_end == kills, f"{restarts} restarts + {at_end} at the end logged, {kills} kills"
        return applied


def save_kill_plan(seed: int, count: int) -> list[list]:
    """``count`` state writes (distinct, seeded) at which the AM kills itself, alternately before and after."""
    rng = random.Random(seed + 2)
    writes = sorted(rng.sample(range(1, LAST_SAVE_KILL + 1), count))
    first = rng.choice(["before", "after"])
    other = "after" if first == "before" else "before"
    return [[n, first if i % 2 == 0 else other] for i, n in enumerate(writes)]


def run_killed_job(tmp: Path, name: str, seed: int, kills: int, save_kills: int = 2) -> KillJob:
    """Run the probe job ``name`` with ``kills`` AM SIGKILLs (phases from ``seed``) and ``save_kills`` self-kills
    at state writes; returns what happened."""
    job = KillJob(name, seed, kill_phases(seed, kills))
    env = elan_env(tmp)
    if save_kills:
        plan = tmp / f"{name}-save-kills.json"
        plan.write_text(json.dumps({"kills": save_kill_plan(seed, save_kills)}))
        env["ELAN_TEST_AM_SAVE_KILLS"] = str(plan)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SAVE_KILL_SITE), env.get("PYTHONPATH")]))
        env["ELAN_PRELOAD_SITECUSTOMIZE"] = "worker"  # it may run in each worker after the fork
    log_path = tmp / f"{name}.log"
    command = elan_command(tmp, name, 2, KILL_ARGS, SCHEDULE)
    with open(log_path, "w") as log_file:
        launcher = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        try:
            _Killer(job, env, launcher, random.Random(seed + 1)).run()
            launcher.wait(JOB_TIMEOUT_S)
        except Exception as error:  # recorded; check() fails with it
            job.error = f"{type(error).__name__}: {error}"
        finally:
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(60)
    job.run = RunResult(tmp / name, tmp / f"{name}-state", launcher.returncode, log_path.read_text())
    job.delivered += _save_kills_delivered(tmp / f"{name}-save-kills.log")
    return job


def _check_schedule_prefix(run: RunResult, static: RunResult, schedule: str, sizes: list[int]) -> None:
    """``check_elastic_run`` for a job whose last requests were cancelled at shutdown: their joiners never trained
    (they leave with nothing trained), every other invariant is the same."""
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    adjustments = run.adjustments()
    assert [len(a["members"]) for a in adjustments] == sizes, adjustments
    check_adjustment_steps(adjustments, schedule, 1, epoch_ends(EPOCHS))
    trained = [record for record in records if record["digests"]]
    left = sorted(record["worker"] for record in trained if record["left"])
    assert left == sorted(worker for a in adjustments for worker in a["leavers"]), "every leaver, and only they, left"
    cancelled = [record["worker"] for record in records if not record["digests"]]
    assert all(record["left"] for record in records if not record["digests"]), f"joiners never used: {cancelled}"


def _save_kills_delivered(log: Path) -> list[str]:
    """``save_before`` / ``save_after`` for each self-kill the AM logged."""
    if not log.exists():
        return []
    return [f"save_{line.split()[1]}" for line in log.read_text().splitlines() if line.strip()]


class _Killer:
    """Walks through a job's kill phases, watching the AM's status in between."""

    def __init__(self, job: KillJob, env: dict[str, str], launcher: subprocess.Popen, rng: random.Random) -> None:
        self.job = job
        self.home = Path(env["ELAN_HOME"])
        self.launcher = launcher
        self.rng = rng
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self._client: AMClient | None = None
        self._killed: int | None = None  # the AM process killed last
        last = EPOCHS * STEPS_PER_EPOCH - 2
        self._steps = iter(sorted(rng.randint(1, last) for _ in job.planned))

    def run(self) -> None:
        try:
            for phase in self.job.planned:
                if not self._kill_in(phase):
                    return  # the job finished before reaching this phase
                self.job.delivered.append(phase)
                if not self._await_new_am():
                    return
        finally:
            if self._client is not None:
                self._client.close()

    # ---- phases

    def _kill_in(self, phase: str) -> bool:
        """Wait for ``phase`` and kill the AM in it; False when the job ended first."""
        if phase == "start":
            return self._await_am() and self._sleep(self.rng.uniform(0.0, 1.0)) and self._kill()
        step = next(self._steps)
        if not self._await_status(lambda status: (status.get("step") or 0) >= step):
            return False
        if phase == "random":
            return self._sleep(self.rng.uniform(0.0, 2.0)) and self._kill()
        if phase == "scale":
            return self._scale_then_kill()
        predicate = _joiner_waits if phase == "waiting" else _in_flight
        return self._await_status(predicate) and self._kill()

    def _scale_then_kill(self) -> bool:
        """Send the extra ``scale`` from a thread, kill the AM a moment later; the client resends the same id."""
        status = self._await_status(lambda s: True, raw=True)
        if not isinstance(status, dict):
            return False
        if self.job.extra_sent or (status.get("step") or 0) > EXTRA_LATEST_STEP:
            return self._sleep(self.rng.uniform(0.0, 2.0)) and self._kill()  # too late for the extra request
        done = threading.Event()
        sender = threading.Thread(target=self._send_extra, args=(done,), daemon=True)
        sender.start()
        time.sleep(self.rng.uniform(0.0, 0.03))
        killed = self._kill()
        sender.join(AM_BACK_TIMEOUT_S + 30)
        assert done.is_set(), "the extra scale request got no reply across the AM restart"
        return killed

    def _send_extra(self, done: threading.Event) -> None:
        """One ``scale`` request, resent with the same id until answered; a refusal (adjustment in flight) retries."""
        with AMClient(self._address(), self.job.name, timeout_s=0.5, retries=60) as client:
            while True:
                try:
                    client.request("scale", EXTRA_BODY)
                    self.job.extra_sent = True
                    break
                except AMError as error:
                    if "in flight" not in str(error):
                        raise
                    time.sleep(0.1)
        done.set()

    # ---- watching the job

    def _await_status(self, predicate: Callable[[dict], bool], raw: bool = False) -> dict | bool:
        """Poll the AM's status until ``predicate`` holds (True, or the status with ``raw``); False if the job ended."""
        while self._running():
            status = self._status()
            if status is not None and predicate(status):
                return status if raw else True
            time.sleep(0.02)
        return False

    def _await_am(self) -> bool:
        """Wait until an AM process (not the one killed last) is registered; False if the job ended first."""
        while self._running():
            if self._live_pid() is not None:
                return True
            time.sleep(0.01)
        return False

    def _await_new_am(self) -> bool:
        """Wait until a new AM process is registered and answers; False if the job ended first."""
        end = time.monotonic() + AM_BACK_TIMEOUT_S
        while self._running():
            if self._live_pid() is not None and self._status() is not None:
                return True
            assert time.monotonic() < end, f"the AM of {self.job.name} did not come back in {AM_BACK_TIMEOUT_S} s"
            time.sleep(0.05)
        return False

    def _status(self) -> dict | None:
        if self._client is None:
            address = self._address()
            if address is None:
                return None
            self._client = AMClient(address, self.job.name, timeout_s=0.3, retries=0)
        try:
            return self._client.status()
        except (AMUnavailable, AMError):
            return None

    def _address(self) -> str | None:
        entry = _registry(self.home, self.job.name)
        return None if entry is None else entry.get("address")

    def _kill(self) -> bool:
        """SIGKILL the registered AM process; False when the job ended first."""
        while self._running():
            pid = self._live_pid()
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                self._killed = pid
                return True
            time.sleep(0.01)
        return False

    def _live_pid(self) -> int | None:
        pid = _am_pid(self.home, self.job.name)
        return None if pid == self._killed else pid

    def _sleep(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self._running():
                return False
            time.sleep(0.01)
        return True

    def _running(self) -> bool:
        assert time.monotonic() < self.deadline, f"job {self.job.name} ran past {JOB_TIMEOUT_S} s"
        return self.launcher.poll() is None


def _joiner_waits(status: dict) -> bool:
    """A joiner reported ready and waits for its plan."""
    pending = status.get("pending") or []
    return any(state == "ready" for request in pending for state in request["worker_status"].values())


def _in_flight(status: dict) -> bool:
    return status.get("in_flight") is not None


def _registry(home: Path, job: str) -> dict | None:
    try:
        return json.loads((home / "jobs" / f"{job}.json").read_text())
    except (OSError, ValueError):
        return None


def _am_pid(home: Path, job: str) -> int | None:
    """The pid of the job's live AM process (an ``elan am`` of this job, not a zombie), else None."""
    entry = _registry(home, job)
    pid = None if entry is None else entry.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    is_am = b"lightning_elan.cli" in cmdline and b"am" in cmdline and job.encode() in cmdline
    return pid if is_am and state != "Z" else None
