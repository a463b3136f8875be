"""The `elan` CLI: argument validation, action/schedule parsing, and `status`/`scale` against a real AM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.procs import free_port
from lightning_elan.cli import main
from lightning_elan.cli_status import describe_request, format_status
from lightning_elan.launcher.schedule import (
    ScaleAction,
    ScheduleError,
    format_scale_args,
    format_schedule,
    parse_action,
    parse_ranks,
    parse_schedule,
)
from lightning_elan.master.registry import job_file as registry_path
from lightning_elan.protocol.contract import StatusReply

REPO = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)`` as the console script would run it: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------- pure parsing


def test_parse_schedule_example() -> None:
    items = parse_schedule("10:add=1,20:remove=rank:0,30:migrate=1,40:to=4")
    assert items == [
        ScaleAction("add", count=1, at_step=10),
        ScaleAction("remove", ranks=(0,), at_step=20),
        ScaleAction("migrate", count=1, at_step=30),
        ScaleAction("to", size=4, at_step=40),
    ]
    assert [item.request_kwargs() for item in items] == [
        {"action": "add", "count": 1, "at_step": 10},
        {"action": "remove", "ranks": [0], "at_step": 20},
        {"action": "migrate", "count": 1, "at_step": 30},
        {"action": "to", "size": 4, "at_step": 40},
    ]


@pytest.mark.parametrize(
    "text",
    [
        "10:add=1,20:remove=rank:0,30:migrate=1,40:to=4",
        "0:remove=rank:2;0;5",
        "5:remove=2,5:add=3",
        "7:to=1",
    ],
)
def test_schedule_round_trip(text: str) -> None:
    items = parse_schedule(text)
    assert format_schedule(items) == text
    assert parse_schedule(format_schedule(items)) == items


def test_schedule_is_sorted_by_step_stably() -> None:
    items = parse_schedule("30:add=1, 10:remove=1 ,30:to=2,10:add=2")
    assert [(item.at_step, item.action) for item in items] == [(10, "remove"), (10, "add"), (30, "add"), (30, "to")]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("10:add", "must look like STEP:ACTION=ARG"),
        ("add=1", "must look like STEP:ACTION=ARG"),
        ("10:=1", "must look like STEP:ACTION=ARG"),
        ("x:add=1", "step must be a non-negative integer, got 'x'"),
        ("-1:add=1", "step must be a non-negative integer"),
        ("10:jump=1", "unknown action 'jump'"),
        ("10:add=0", "count for 'add' must be an integer >= 1"),
        ("10:add=two", "count for 'add' must be an integer >= 1"),
        ("10:to=0", "size for 'to' must be an integer >= 1"),
        ("10:add=rank:0", "only remove accepts a rank list"),
        ("10:remove=rank:", "names no rank"),
        ("10:remove=rank:1;x", "rank in 'rank:1;x' must be a non-negative integer"),
        ("10:remove=rank:1;1", "rank 1 is listed twice"),
        ("10:add=1,", "empty schedule item"),
        ("", "schedule is empty"),
    ],
)
def test_bad_schedule(text: str, problem: str) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_schedule(text)
    assert problem in str(info.value)


@pytest.mark.parametrize(
    ("action", "arg", "expected"),
    [
        ("add", "2", ScaleAction("add", count=2)),
        ("remove", "1", ScaleAction("remove", count=1)),
        ("remove", "rank:3", ScaleAction("remove", ranks=(3,))),
        ("remove", "rank:0,2", ScaleAction("remove", ranks=(0, 2))),
        ("migrate", "1", ScaleAction("migrate", count=1)),
        ("to", "4", ScaleAction("to", size=4)),
    ],
)
def test_parse_action_round_trip(action: str, arg: str, expected: ScaleAction) -> None:
    parsed = parse_action(action, arg)
    assert parsed == expected
    assert format_scale_args(parsed) == [action, arg]
    with_step = parse_action(action, arg, at_step=7)
    assert format_scale_args(with_step) == ["--at-step", "7", action, arg]


def test_parse_ranks() -> None:
    assert parse_ranks("rank:4,1") == (4, 1)
    assert parse_ranks("rank:4;1", ";") == (4, 1)
    with pytest.raises(ScheduleError, match="must look like rank:R"):
        parse_ranks("4,1")


# ---------------------------------------------------------------------- argument validation


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["run", "--nproc", "0", "--job", "j", "--", "true"], "--nproc: must be an integer in 1..4096, got '0'"),
        (["run", "--nproc", "two", "--job", "j", "--", "true"], "argument --nproc: must be an integer in 1..4096"),
        (["run", "--nproc", "2", "--job", "j", "--coordinate-every", "0", "--", "true"], "--coordinate-every"),
        (["run", "--nproc", "2", "--job", "j", "--schedule", "10:add", "--", "true"], "'10:add' must look like"),
        (["run", "--nproc", "2", "--job", "j", "--schedule", "x:add=1", "--", "true"], "step must be a non-negative"),
        (["run", "--nproc", "2", "--job", "j", "--schedule", "10:jump=1", "--", "true"], "unknown action 'jump'"),
        (["run", "--nproc", "2", "--job", "j"], "missing worker command after `--`"),
        (["run", "--nproc", "2", "--job", "j", "--"], "missing worker command after `--`"),
        (["run", "--nproc", "2", "--job", "j", "--", "no-such-elan-cmd"], "'no-such-elan-cmd' not found on PATH"),
        (["run", "--nproc", "2", "--job", "j", "--devices", "tpu", "--", "true"], "argument --devices"),
        (["run", "--nproc", "2", "--job", "j", "--term-grace", "0", "--", "true"],
         "argument --term-grace: must be a number > 0, got '0'"),
        (["run", "--nproc", "2", "--job", "j", "--term-grace", "-5", "--", "true"], "must be a number > 0, got '-5'"),
        (["run", "--nproc", "2", "--job", "j", "--term-grace", "soon", "--", "true"], "must be a number > 0"),
        (["run", "--nproc", "2", "--job", "j", "--term-grace", "inf", "--", "true"],
         "argument --term-grace: must be a finite number > 0, got 'inf'"),
        (["run", "--job", "j", "--", "true"], "required: --nproc"),
        (["run", "--nproc", "2", "--job", "j", "--min-workers", "0", "--", "true"], "argument --min-workers"),
        (["run", "--nproc", "2", "--job", "j", "--min-workers", "3", "--", "true"], "--min-workers 3 is more than"),
        (["run", "--nproc", "2", "--job", "j", "--join-timeout", "-1", "--", "true"], "argument --join-timeout"),
        (["run", "--nproc", "1", "--job", "../x", "--", "true"], "invalid job name"),
        (["scale", "--job", "j", "add", "0"], "count for 'add' must be an integer >= 1, got '0'"),
        (["scale", "--job", "j", "remove", "rank:1,x"], "rank in 'rank:1,x' must be a non-negative integer"),
        (["scale", "--job", "j", "remove", "rank:"], "names no rank"),
        (["scale", "--job", "j", "remove", "rank:1,1"], "rank 1 is listed twice"),
        (["scale", "--job", "j", "migrate", "-1"], "count for 'migrate' must be an integer >= 1"),
        (["scale", "--job", "j", "to", "0"], "size for 'to' must be an integer >= 1"),
        (["scale", "--job", "j", "grow", "1"], "unknown action 'grow'"),
        (["scale", "--job", "j", "add"], "required: ARG"),
        (["scale", "--job", "j", "--at-step", "-3", "add", "1"], "argument --at-step: must be a non-negative integer"),
        (["status", "--job", "j", "--timeout", "0"], "argument --timeout: must be a number > 0"),
        (["status", "--job", "j", "--", "x"], "only `elan run` and `elan worker` take a worker command"),
        (["status", "--job", "j", "--am", "host:"], "argument --am: bad AM address 'host:': the port must be"),
        (["scale", "--job", "j", "--am", "h:99999", "add", "1"], "argument --am: bad AM address 'h:99999'"),
        (["worker", "--job", "j", "--", "true"], "the AM's address is needed: --am HOST:PORT (or $ELAN_AM)"),
        (["worker", "--am", "h:1", "--", "true"], "the job's name is needed: --job NAME (or $ELAN_JOB)"),
        (["worker", "--am", "h:1", "--job", "j"], "missing worker command after `--`"),
        (["worker", "--am", "h:1,", "--job", "j", "--", "true"], "argument --am: bad AM address list 'h:1,'"),
        (["worker", "--am", "h:1", "--job", "j", "--iface", "no-such-if0", "--", "true"],
         "--iface 'no-such-if0': no such network interface here"),
        (["worker", "--am", "h:1", "--job", "j", "--enrol-timeout", "0", "--", "true"], "argument --enrol-timeout"),
        (["am", "--job", "j", "--max-workers", "3"], "--max-workers needs --min-workers"),
        (["am", "--job", "j", "--min-workers", "3", "--max-workers", "2"],
         "--max-workers 2 is less than --min-workers 3"),
        (["am", "--job", "j", "--min-workers", "2", "--start-grace", "-1"], "argument --start-grace: must be a number"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert out == ""
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert problem in error_lines[0]


def test_module_entry_point_reports_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "0", "--job", "j", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "elan run: error: argument --nproc: must be an integer in 1..4096, got '0'" in result.stderr


# ---------------------------------------------------------------------- against a real AM


@pytest.fixture
def elan_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("ELAN_HOME", str(home))
    return home


@pytest.fixture
def running_job(elan_home: Path) -> Iterator[str]:
    """A real AM for job ``demo`` on 127.0.0.1, started in-process, holding a 2-worker generation 0."""
    from lightning_elan.master import ApplicationMaster, FileStore
    from lightning_elan.protocol.client import AMClient

    state_dir = elan_home / "jobs" / "demo"
    state_dir.mkdir(parents=True)
    am = ApplicationMaster("demo", FileStore(state_dir / "state.json"), state_dir=state_dir)
    am.start()
    try:
        with AMClient(am.address, "demo") as client:
            client.request("start_job", {"nproc": 2, "coordinate_every": 5})
        yield "demo"
    finally:
        am.stop()


def test_unknown_job(elan_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["status", "--job", "ghost"], capsys)
    assert code == 2
    assert out == ""
    assert err.strip() == f"elan: error: no running job named ghost (looked in {registry_path('ghost')})"
    code, _, err = run_cli(["scale", "--job", "ghost", "add", "1"], capsys)
    assert code == 2
    assert "no running job named ghost" in err


def test_am_not_answering(elan_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    path = registry_path("mute")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job": "mute", "address": address, "pid": os.getpid(), "state_dir": "x"}))
    code, out, err = run_cli(["status", "--job", "mute", "--timeout", "0.1"], capsys)
    assert code == 2
    assert out == ""
    assert err.strip() == f"elan: error: job mute's AM at {address} does not answer"


def test_stale_registry_fails_fast(elan_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    address = f"tcp://127.0.0.1:{free_port()}"
    path = registry_path("gone")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job": "gone", "address": address, "pid": dead.pid, "state_dir": "x"}))
    code, _, err = run_cli(["scale", "--job", "gone", "add", "1"], capsys)
    assert code == 2
    assert f"elan: error: job gone's AM at {address} does not answer (its process {dead.pid} is gone" in err


def test_status_json(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["status", "--job", running_job, "--json"], capsys)
    assert code == 0, err
    status = json.loads(out)
    assert status["job"] == "demo"
    assert status["generation"] == 0
    assert [member["worker_id"] for member in status["members"]] == ["w0", "w1"]
    assert [member["rank"] for member in status["members"]] == [0, 1]
    assert status["in_flight"] is None
    assert status["finished"] is False


def test_scale_then_status(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["scale", "--job", running_job, "--at-step", "20", "add", "1"], capsys)
    assert code == 0, err
    assert out.startswith("request ")
    assert "add 1 at step 20 (new workers: w2)" in out

    code, out, err = run_cli(["status", "--job", running_job, "--json"], capsys)
    assert code == 0, err
    pending = json.loads(out)["pending"]
    assert len(pending) == 1
    assert pending[0]["action"] == "add"

    code, out, err = run_cli(["status", "--job", running_job], capsys)
    assert code == 0, err
    assert "job demo: generation 0, running" in out
    assert "RANK  WORKER  HOST" in out
    assert "failed or cancelled: none" in out
    assert f"AM: pid {os.getpid()} at tcp://127.0.0.1:" in out and "never restarted" in out
    assert "pending requests (1):" in out
    assert "add 1 at step 20" in out
    assert "in flight: none" in out
    assert "last adjustment: none" in out


def test_scale_refused_by_am(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["scale", "--job", running_job, "remove", "rank:7"], capsys)
    assert code == 1
    assert out == ""
    assert err.startswith("elan: error: ")
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["scale", "--job", running_job, "to", "1"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["scale", "--job", running_job, "remove", "1"], capsys)
    assert code == 1  # the job must keep at least one worker
    assert err.startswith("elan: error: ")


# ---------------------------------------------------------------------- human output


def test_format_status_full() -> None:
    status = {
        "job": "demo",
        "generation": 2,
        "members": [
            {"worker_id": "w3", "rank": 1, "host": "box", "device": "cuda:1", "pid": 12},
            {"worker_id": "w0", "rank": 0, "host": "box", "device": "cuda:0", "pid": 11},
        ],
        "step": 40,
        "epoch": 1,
        "position": 1280,
        "global_batch": 32,
        "pending": [{"request_id": "r4", "action": "remove", "ranks": [0], "at_step": 60}],
        "in_flight": {
            "request_id": "r3",
            "action": "add",
            "generation": 3,
            "previous_generation": 2,
            "step": 40,
            "members": ["w0", "w3", "w4"],
            "previous_members": ["w0", "w3"],
            "joiners": ["w4"],
            "leavers": [],
            "sources": {"w4": "w0"},
            "hosts": {"w0": "box", "w3": "box", "w4": "box"},
        },
        "last_adjustment": {
            "request_id": "r2",
            "action": "migrate",
            "step": 20,
            "generation": 2,
            "joiners": ["w3"],
            "leavers": ["w1"],
            "pause_s": {"w0": 0.25, "w3": 0.5},
            "bytes_replicated": 45_000_000,
            "requested_at": 100.0,
            "completed_at": 103.5,
        },
        "finished": False,
    }
    text = format_status(StatusReply.from_body(status))
    lines = text.splitlines()
    assert lines[0] == "job demo: generation 2, running"
    assert lines[1] == "members (2):"
    assert lines[2].split() == ["RANK", "WORKER", "HOST", "DEVICE", "PID", "LAST_STEP", "FROM"]
    assert lines[3].split() == ["0", "w0", "box", "cuda:0", "11", "-", "-"]
    assert lines[4].split() == ["1", "w3", "box", "cuda:1", "12", "-", "-"]
    assert "progress: step 40, epoch 1, position 1280, global batch 32" in text
    assert "  r4: remove rank:0 at step 60" in text
    assert "in flight: r3 add at step 40: generation 2 → 3, members w0,w3,w4, joiners w4, leavers none" in text
    assert "last adjustment: r2 migrate at step 20 → generation 2, joiners w3, leavers w1" in text
    assert "pause max 0.500 s, 45.0 MB replicated, 3.50 s from request to completion" in text


def test_format_status_shows_a_recovery_and_a_dead_worker() -> None:
    status = {
        "job": "j", "generation": 0, "members": [], "finished": False, "failed_reason": None,
        "recovery": {"failure_id": "f1", "dead": ["w1"], "survivors": ["w0", "w2"], "checked_in": ["w0"]},
        "failures": [{"kind": "worker", "outcome": "died", "worker_id": "w1", "returncode": -9, "generation": 0,
                      "failure_id": "f1", "step": 5}],
    }

    text = format_status(StatusReply.from_body(status))

    assert "recovering (f1): w1 died; checked in: w0 of w0, w2" in text
    assert "worker w1 (generation 0, exit code -9): died at step 5: recovered by f1" in text
    failed = StatusReply.from_body({**status, "finished": True, "failed_reason": "no survivor"})
    assert "job j: generation 0, failed: no survivor" in format_status(failed)


def test_format_status_says_replace_failed_stopped() -> None:
    status = {"job": "j", "generation": 5, "members": [], "finished": False, "failed_reason": None,
              "failures": [{"kind": "replacement", "outcome": "stopped", "worker_id": "w5",
                            "reason": "3 replacements in a row died before they trained"}]}

    text = format_status(StatusReply.from_body(status))

    assert "--replace-failed (after w5): stopped: 3 replacements in a row died before they trained" in text


def test_format_status_shows_who_waits_for_the_start_of_a_job_of_elan_workers() -> None:
    status = {"job": "j", "generation": 0, "members": [], "finished": False,
              "enrolment": {"min_workers": 2, "max_workers": 4, "started": False,
                            "waiting": [{"worker_id": "w0", "host": "node-a", "pid": 7}]}}

    waiting = format_status(StatusReply.from_body(status))
    assert "enrolment: 2–4 workers; waiting for the start: w0 (node-a pid 7)" in waiting
    started = {**status, "enrolment": {**status["enrolment"], "started": True, "waiting": []}}
    assert "enrolment: 2–4 workers; started" in format_status(StatusReply.from_body(started))


def test_describe_request_variants() -> None:
    assert describe_request({"request_id": "r1", "action": "to", "size": 3}) == "r1: to 3"
    assert (
        describe_request({"request_id": "r2", "action": "add", "count": 2, "new_workers": ["w5", "w6"]})
        == "r2: add 2 (new workers: w5, w6)"
    )
    assert describe_request({"request_id": "r3", "action": "leave", "workers": ["w1", "w4"]}) == "r3: leave w1, w4"


# ---------------------------------------------------------------------- launcher helpers and lifecycle


def test_pick_device_round_robin_then_least_loaded() -> None:
    from lightning_elan.launcher.run import pick_device

    assert [pick_device([0, 0, 0], cursor) for cursor in range(3)] == [0, 1, 2]
    assert pick_device([1, 1, 1], 1) == 1
    assert pick_device([1, 0, 1], 0) == 1  # a device freed by a leaver is refilled first
    assert pick_device([2, 1, 1], 0) == 1


def test_describe_exit() -> None:
    from lightning_elan.launcher.run import describe_exit

    assert describe_exit(0, True) == "exited with code 0 (expected)"
    assert describe_exit(3, False) == "exited with code 3"
    assert describe_exit(-9, False) == "was killed by SIGKILL"


def test_archive_previous_run(tmp_path: Path) -> None:
    from lightning_elan.launcher.run import archive_previous_run

    assert archive_previous_run(tmp_path) is None
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "adjustments.jsonl").write_text("{}\n")
    archive = archive_previous_run(tmp_path)
    assert archive == tmp_path / "previous"
    assert sorted(path.name for path in archive.iterdir()) == ["adjustments.jsonl", "state.json"]
    assert not (tmp_path / "state.json").exists()
    (tmp_path / "state.json").write_text('{"second": true}')
    archive_previous_run(tmp_path)
    assert sorted(path.name for path in archive.iterdir()) == ["state.json"]
    assert (archive / "state.json").read_text() == '{"second": true}'


def test_run_refuses_a_job_that_is_already_running(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "--nproc", "1", "--job", running_job, "--", "true"], ["am", "--job", running_job]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2
        assert f"error: job {running_job} is already running (AM at tcp://127.0.0.1:" in err


def test_run_cuda_without_devices(elan_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 0:
        pytest.skip("a CUDA device is visible")
    code, _, err = run_cli(["run", "--nproc", "1", "--job", "g", "--devices", "cuda", "--", "true"], capsys)
    assert code == 2
    assert "elan run: error: --devices cuda, but no CUDA device is visible" in err


def test_am_command_serves_until_sigint(elan_home: Path) -> None:
    import signal
    import time

    from lightning_elan.master import registry

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    am = subprocess.Popen(
        [sys.executable, "-m", "lightning_elan.cli", "am", "--job", "solo"],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while registry.read("solo") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        status = subprocess.run(
            [sys.executable, "-m", "lightning_elan.cli", "status", "--job", "solo", "--json"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["job"] == "solo"
        am.send_signal(signal.SIGINT)
        _, stderr = am.communicate(timeout=30)
    finally:
        if am.poll() is None:
            am.kill()
    assert am.returncode == 0, stderr
    assert "elan: received SIGINT: stopping the AM of job 'solo'" in stderr.splitlines(), stderr
    assert registry.read("solo") is None
    assert (elan_home / "jobs" / "solo").is_dir()


def test_format_status_shows_last_steps_the_am_and_failures_with_their_cause() -> None:
    status = {
        "job": "demo",
        "generation": 1,
        "finished": False,
        "members": [
            {"worker_id": "w0", "rank": 0, "host": "box", "device": "cpu", "pid": 11, "last_step": 40,
             "last_step_from": "coordinate"},
            {"worker_id": "w2", "rank": 1, "host": "box", "device": "cpu", "pid": 13, "last_step": 31,
             "last_step_from": "report"},
        ],
        "am": {"pid": 4242, "address": "tcp://127.0.0.1:5555", "restarts": 2},
        "failures": [
            {"kind": "request", "outcome": "failed", "request_id": "r2", "action": "add", "count": 1,
             "new_workers": ["w3"], "step": 35, "at": None,
             "reason": "worker w3 did not report ready within 600 s"},
            {"kind": "adjustment", "outcome": "failed", "request_id": "r3", "action": "migrate", "generation": 2,
             "step": None, "reason": "joiner w4 exited with code 9 after its plan was decided"},
        ],
    }

    lines = format_status(StatusReply.from_body(status)).splitlines()

    assert lines[3].split() == ["0", "w0", "box", "cpu", "11", "40", "coordinate"]
    assert lines[4].split() == ["1", "w2", "box", "cpu", "13", "31", "report"]
    assert "AM: pid 4242 at tcp://127.0.0.1:5555, restarted 2 times" in lines
    index = lines.index("failed or cancelled (2):")
    assert lines[index + 1] == (
        "  r2: add 1 (new workers: w3): failed at step 35: worker w3 did not report ready within 600 s"
    )
    assert lines[index + 2] == (
        "  r3 migrate adjustment to generation 2: failed: joiner w4 exited with code 9 after its plan was decided"
    )


def test_status_of_a_job_whose_joiner_never_reported(running_job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 10, item 6: a request whose joiner never reported ready stays visible, with the reason."""
    from lightning_elan.protocol.client import AMClient

    entry = json.loads(registry_path(running_job).read_text())
    with AMClient(entry["address"], running_job) as client:
        client.scale("add", count=1)
        client.request("launcher_poll")
        client.request("worker_exit", {"worker_id": "w2", "returncode": 1})

    code, out, err = run_cli(["status", "--job", running_job], capsys)
    assert code == 0, err
    assert "failed or cancelled (1):" in out
    assert "r1: add 1 (new workers: w2): failed" in out and "worker w2 exited with code 1" in out
    code, out, err = run_cli(["status", "--job", running_job, "--json"], capsys)
    [failure] = json.loads(out)["failures"]
    assert failure["reason"] == "worker w2 exited with code 1 before its plan was decided"


def test_run_gives_its_workers_the_term_grace(
    elan_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--term-grace` (default 30 s) reaches every worker as ELAN_TERM_GRACE."""
    from lightning_elan.launcher import run as launcher_run
    from lightning_elan.protocol.contract import WorkerEnvironment

    configs = []

    class Recorder(launcher_run.JobLauncher):
        def run(self) -> int:
            configs.append(self.config)
            description = WorkerEnvironment.launched(
                job="j", worker_id="w0", role="member", am_address="tcp://127.0.0.1:1", store_address="127.0.0.1:2",
                rank=0, world_size=1, term_grace_s=self.config.term_grace_s,
            )
            assert WorkerEnvironment.from_env(self._worker_env(description)).term_grace_s == self.config.term_grace_s
            return 0

    monkeypatch.setattr(launcher_run, "JobLauncher", Recorder)
    assert run_cli(["run", "--nproc", "1", "--job", "g", "--term-grace", "7.5", "--", "true"], capsys)[0] == 0
    assert run_cli(["run", "--nproc", "1", "--job", "g", "--", "true"], capsys)[0] == 0
    assert [config.term_grace_s for config in configs] == [7.5, 30.0]
