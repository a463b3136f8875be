"""Issue 26 item 5: a quieter default log whose lines say what happened — why the AM stopped, what ``elan autoscale``
did, the current members in ``elan status``, counts with the right noun, and sentences instead of dicts at info."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_elan import cli_status
from lightning_elan.cli import main
from lightning_elan.cli_status import describe_am, describe_enrolment, format_status
from lightning_elan.launcher.lifeline import die_with_parent
from lightning_elan.master.main import CLEAN_FINISHES, Stop, stop_line
from lightning_elan.master.server import scale_line
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import launching, recovering, requests
from lightning_elan.protocol.contract import FINISHED_BY_AM, FINISHED_BY_LAUNCHER, AMStatus, StatusReply
from lightning_elan.words import describe_autoscale
from tests.unit.am_steps import exited

REPO = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def running_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real AM for job ``demo``, in-process, holding a 2-worker generation 0."""
    from lightning_elan.master import ApplicationMaster, FileStore
    from lightning_elan.protocol.client import AMClient

    monkeypatch.setenv("ELAN_HOME", str(tmp_path / "home"))
    state_dir = tmp_path / "home" / "jobs" / "demo"
    state_dir.mkdir(parents=True)
    am = ApplicationMaster("demo", FileStore(state_dir / "state.json"), state_dir=state_dir)
    am.start()
    try:
        with AMClient(am.address, "demo") as client:
            client.request("start_job", {"nproc": 2, "coordinate_every": 5})
        yield "demo"
    finally:
        am.stop()


# ---------------------------------------------------------------------- 1. why the AM stopped


@pytest.mark.parametrize(
    ("stop", "finished", "reason", "level", "line"),
    [
        (Stop("signal", "SIGTERM"), True, "all members finished", logging.INFO,
         "AM of job 'x' stopped: the job finished"),
        (Stop("done"), True, "training complete: every member finished", logging.INFO,
         "AM of job 'x' stopped: the job finished"),
        (Stop("signal", "SIGTERM"), True, "the launcher received SIGINT", logging.INFO,
         "AM of job 'x' stopped: the job was stopped: the launcher received SIGINT"),
        (Stop("done"), True, "failed: no survivor checked in after f1", logging.INFO,
         "AM of job 'x' stopped: the job failed: no survivor checked in after f1"),
        (Stop("signal", "SIGTERM"), True, "shutdown", logging.INFO, "AM of job 'x' stopped: the job was shut down"),
        (Stop("done"), True, None, logging.INFO, "AM of job 'x' stopped: the job is over"),
        (Stop("parent", "SIGTERM", 42), False, None, logging.WARNING,
         "AM of job 'x' stopped: its launcher (pid 42) is gone"),
        (Stop("parent", parent_pid=42), False, None, logging.WARNING,
         "AM of job 'x' stopped: its launcher (pid 42) is gone"),
        (Stop("signal", "SIGTERM"), False, None, logging.INFO, "received SIGTERM: stopping the AM of job 'x'"),
        (Stop("signal", "SIGINT"), False, None, logging.INFO, "received SIGINT: stopping the AM of job 'x'"),
    ],
)
def test_the_am_says_why_it_stops(stop: Stop, finished: bool, reason: str | None, level: int, line: str) -> None:
    assert stop_line("x", stop, finished, reason) == (level, line)


def test_the_clean_finishes_are_the_ones_the_launcher_and_the_am_send() -> None:
    """The shutdown reasons read as "the job finished" are the ones ``elan run`` and the AM itself send."""
    assert CLEAN_FINISHES == (FINISHED_BY_LAUNCHER, FINISHED_BY_AM)
    assert stop_line("x", Stop("done"), True, FINISHED_BY_LAUNCHER)[1] == "AM of job 'x' stopped: the job finished"
    assert stop_line("x", Stop("done"), True, FINISHED_BY_AM)[1] == "AM of job 'x' stopped: the job finished"


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, ELAN_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _wait_for_registry(home: Path, job: str, timeout_s: float = 60.0) -> dict[str, object]:
    path = home / "jobs" / f"{job}.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            entry = None
        if entry and entry.get("address"):
            return entry
        time.sleep(0.05)
    raise AssertionError(f"no registry entry for {job} within {timeout_s} s")


def test_an_am_stopped_by_its_launcher_after_the_job_finished_says_so(tmp_path: Path) -> None:
    """What ``elan run`` does at a clean end — ``shutdown`` "all members finished", then SIGTERM — read by a real
    ``elan am``: one info line saying the job finished, no "received SIGTERM"."""
    from lightning_elan.protocol.client import AMClient

    home = tmp_path / "home"

    def finish_the_job() -> None:
        entry = _wait_for_registry(home, "fin")
        with AMClient(str(entry["address"]), "fin") as client:
            client.request("start_job", {"nproc": 1})
            client.request("shutdown", {"reason": "all members finished"})

    returncode, stderr = _sigterm_am(home, "fin", ["--parent-pid", str(os.getpid())], before=finish_the_job)
    assert returncode == 0, stderr
    assert "elan: AM of job 'fin' stopped: the job finished" in stderr.splitlines(), stderr
    assert "received SIGTERM" not in stderr and "warning" not in stderr, stderr


PARENT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from lightning_elan.launcher.lifeline import die_with_parent

    log = open(sys.argv[1], "w")
    am = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", "am", "--job", "orphan", "--parent-pid",
                           str(os.getpid())], stderr=log, start_new_session=True,
                          preexec_fn=die_with_parent(signal.SIGTERM, hold_sigterm=True))
    print(am.pid, flush=True)
    time.sleep(600)
    """
)


def test_an_am_whose_launcher_died_says_so(tmp_path: Path) -> None:
    """As ``elan run`` starts it (own session, SIGTERM when its parent dies): SIGKILL the parent mid-job and the AM's
    last line names its launcher gone, as a warning — not an outside SIGTERM."""
    home, log = tmp_path / "home", tmp_path / "am.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(log)], env=_env(home), cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    am_pid = None
    try:
        am_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        _wait_for_registry(home, "orphan")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while (home / "jobs" / "orphan.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (home / "jobs" / "orphan.json").exists(), log.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if am_pid is not None:
            _end(am_pid)
    text = log.read_text()
    assert f"elan: warning: AM of job 'orphan' stopped: its launcher (pid {parent.pid}) is gone" in text, text
    assert "received SIGTERM" not in text, text


def test_an_am_told_to_stop_while_it_starts_stops_cleanly(tmp_path: Path) -> None:
    """As ``elan run`` starts it (SIGTERM held until its handler is in place): a SIGTERM while it still imports is a
    stop, not a death — it exits 0, says so, and leaves no registry entry behind (CI at deaa96a: a launcher killed just
    as its AM registered left the entry of a dead AM)."""
    home = tmp_path / "home"
    returncode, stderr = _sigterm_am(home, "early", preexec_fn=die_with_parent(signal.SIGTERM, hold_sigterm=True))
    assert returncode == 0, stderr
    assert "elan: received SIGTERM: stopping the AM of job 'early'" in stderr.splitlines(), stderr
    assert not (home / "jobs" / "early.json").exists()


def test_an_am_told_to_stop_as_it_registers_removes_its_entry(tmp_path: Path) -> None:
    """A SIGTERM the moment the registry entry appears (before ``elan am`` logs that it serves) is a clean stop."""
    home = tmp_path / "home"

    def until_registered() -> None:
        deadline = time.monotonic() + 60
        while not (home / "jobs" / "racing.json").exists() and time.monotonic() < deadline:
            time.sleep(0.001)

    returncode, stderr = _sigterm_am(home, "racing", before=until_registered)
    assert returncode == 0, stderr
    assert not (home / "jobs" / "racing.json").exists(), stderr


def _sigterm_am(home: Path, job: str, args: list[str] | None = None, before: Callable[[], None] = lambda: None,
                preexec_fn: Callable[[], None] | None = None) -> tuple[int, str]:
    """Start ``elan am --job JOB ARGS``, run ``before()``, SIGTERM it; its exit code and stderr (killed past 60 s)."""
    am = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", "am", "--job", job, *(args or [])],
                          env=_env(home), cwd=REPO, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    try:
        before()
        am.send_signal(signal.SIGTERM)
        _, stderr = am.communicate(timeout=60)
    finally:
        if am.poll() is None:
            am.kill()
            am.wait()
    return am.returncode, stderr


def _end(pid: int, timeout_s: float = 10.0) -> None:
    """Wait for the AM (not our child) to exit; SIGKILL it past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- 2. elan autoscale in words


def test_autoscale_off_says_so_in_words(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["autoscale", "--job", running_job, "--policy", "off"], capsys)
    assert code == 0, err
    assert out.strip() == "autoscaling of job 'demo' is off"


def test_autoscale_on_says_the_policy_and_its_bounds(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["autoscale", "--job", running_job, "--policy", "throughput", "--max-workers", "4"],
                             capsys)
    assert code == 0, err
    assert out.strip() == ("autoscaling of job 'demo' is on: throughput policy, 1 to 4 workers, 1 worker a step, "
                           "a decision every 20 measured steps, grows while the scaling efficiency is above 0.1")
    assert "{" not in out and "null" not in out


def test_describe_autoscale_variants() -> None:
    utility = {"policy": "utility", "config": {"min_workers": 2, "max_workers": None, "step": 2, "every": 1,
                                               "threshold": 0.1, "price": 0.0008, "cooldown_s": 30.0}}
    assert describe_autoscale("j", utility, "sbatch w.sh") == (
        "autoscaling of job 'j' is on: utility policy, at least 2 workers, 2 workers a step, a decision every "
        "1 measured step, 0.0008 per worker-second, at least 30 s between decisions; growth runs 'sbatch w.sh'")
    assert describe_autoscale("j", None, "kubectl scale") == (
        "autoscaling of job 'j' is off; growth runs 'kubectl scale'")


# ---------------------------------------------------------------------- 3. status shows the current members


def test_status_compute_line_lists_the_current_members_only() -> None:
    """w1 left (its score is still in the detector), w3 joined (no round with it yet): the line shows w0, w3."""
    status = {
        "job": "demo", "generation": 3, "finished": False,
        "members": [{"worker_id": "w3", "rank": 1}, {"worker_id": "w0", "rank": 0}],
        "sizing": {"stragglers": {"mode": "replace"},
                   "measured": {"samples_per_s": {"1": 90.0, "2": 170.0},
                                "straggler_scores": {"w0": 1.0, "w1": 0.42},
                                "stragglers": ["w1"], "compute_s": {"w0": 0.01}}},
    }
    lines = format_status(StatusReply.from_body(status)).splitlines()
    assert "compute (EWMA of throughput / median, stragglers replace): w0 1.00, w3 not scored yet" in lines
    assert not any("w1" in line for line in lines)
    assert "throughput: 1 worker 90.0/s, 2 workers 170.0/s" in lines


def test_status_json_is_unchanged_by_the_rendering(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["status", "--job", running_job, "--json"], capsys)
    status = json.loads(out)
    assert code == 0 and set(status["sizing"]["measured"]) == {
        "samples_per_s", "current", "compute_s", "straggler_scores", "stragglers"}


def test_sizing_lines_are_sentences_not_json() -> None:
    sizing = {
        "profile": {"run": {"min_size": 1, "max_size": 3, "start_size": 2, "steps": 5, "settle": "return"},
                    "measured": {"2": 190.0}},
        "profile_result": {"rates": {"1": 100.0, "2": 190.0, "3": 260.0}, "best": 3},
        "autoscale": {"policy": "throughput", "config": {"min_workers": 1, "max_workers": 3, "step": 1, "every": 20,
                                                         "threshold": 0.1}},
    }
    lines = cli_status.format_sizing(sizing, ["w0", "w1"])
    assert lines == [
        "profile running (2 → 1 → 3 → 2 workers): measured 2 workers 190.0/s",
        "last profile: 1 worker 100.0/s, 2 workers 190.0/s, 3 workers 260.0/s; best 3 workers",
        "autoscale: throughput policy, 1 to 3 workers, 1 worker a step, a decision every 20 measured steps, grows "
        "while the scaling efficiency is above 0.1",
    ]


def test_profile_says_its_route(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["profile", "--job", running_job, "--min", "1", "--max", "3", "--steps", "1",
                              "--no-wait"], capsys)
    assert code == 0, err
    assert out.strip() == "profile of job 'demo' started: 2 → 1 → 3 → 2 workers, 1 step measured at each size"


# ---------------------------------------------------------------------- 6. counts with the right noun


def test_counts_take_the_right_noun() -> None:
    assert describe_am(AMStatus(1, pid=1)) == "AM: pid 1, restarted 1 time"
    assert describe_am(AMStatus(2, pid=1)) == "AM: pid 1, restarted 2 times"
    assert describe_enrolment({"min_workers": 1, "max_workers": 1, "started": True}) == "enrolment: 1 worker; started"
    assert describe_enrolment({"min_workers": 2, "max_workers": 4, "started": True}) == (
        "enrolment: 2–4 workers; started")
    state = JobState("j")
    launching.start_job(state, 1)
    for request, message in [({"action": "remove", "count": 1}, "cannot remove the only worker"),
                             ({"action": "migrate", "count": 2}, "cannot migrate 2 workers: the job has only 1"),
                             ({"action": "to", "size": 1}, "the job already has 1 worker (counting pending")]:
        with pytest.raises(StateError, match=re.escape(message)):
            requests.scale(state, **request)


def test_the_enrolment_option_error_agrees_with_its_count(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, one = run_cli(["am", "--job", "j", "--max-workers", "3"], capsys)
    _, _, two = run_cli(["am", "--job", "j", "--max-workers", "3", "--start-grace", "1"], capsys)
    assert "--max-workers needs --min-workers" in one
    assert "--max-workers, --start-grace need --min-workers" in two


# ---------------------------------------------------------------------- 7. sentences at info, the raw form at debug


@pytest.mark.parametrize(
    ("asked", "new_workers", "line"),
    [
        ({"action": "add", "count": 1}, ["w3"], "job 'x' queues r1: add 1 worker (new worker w3)"),
        ({"action": "add", "count": 2, "at_step": 20}, ["w3", "w4"],
         "job 'x' queues r1: add 2 workers at step 20 (new workers w3 and w4)"),
        ({"action": "remove", "ranks": [0]}, [], "job 'x' queues r1: remove rank 0"),
        ({"action": "remove", "ranks": [1, 2]}, [], "job 'x' queues r1: remove ranks 1 and 2"),
        ({"action": "to", "size": 3}, ["w5"], "job 'x' queues r1: resize to 3 workers (new worker w5)"),
    ],
)
def test_scale_line(asked: dict[str, object], new_workers: list[str], line: str) -> None:
    assert scale_line("x", "r1", asked, new_workers) == line


def test_a_scale_request_is_one_sentence_at_info_and_its_dict_at_debug(
    running_job: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="lightning_elan.master.server"):
        code, _, err = run_cli(["scale", "--job", running_job, "add", "1"], capsys)
    assert code == 0, err
    info = [r.getMessage() for r in caplog.records if r.name.endswith("server") and r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.name.endswith("server") and r.levelno == logging.DEBUG]
    assert "job 'demo' queues r1: add 1 worker (new worker w2)" in info
    assert not any("{" in line or "[" in line for line in info), info
    assert any('{"action": "add", "count": 1}' in line for line in debug), debug


def test_the_recovery_plan_is_a_sentence_at_info(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_elan.protocol.contract import RecoverRequest

    state = JobState("j")
    launching.start_job(state, 3)
    with caplog.at_level(logging.DEBUG, logger="lightning_elan.master.transitions.recovering"):
        exited(state, "w1", 1)
        for worker in ("w0", "w2"):
            recovering.recover(state, RecoverRequest(worker_id=worker, generation=0, step=5, has_state=True))
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "job j recovers from f1 (w1 died): generation 1 will train with w0 and w2" in info, info
    assert any(r.levelno == logging.DEBUG and "recovery plan f1" in r.getMessage() for r in caplog.records)
