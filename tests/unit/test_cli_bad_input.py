"""Every ``elan`` command fed wrong input, through the real command line (``python -m lightning_elan.cli``): one
clear ``error:`` line naming the problem, a non-zero exit (2 for usage errors), never a Python traceback.

Wrong forms: bad addresses, negative/zero/NaN/infinite numbers, unknown jobs, missing required arguments, garbage
for choices, files that are missing or garbage, an AM address where nothing listens (with a short timeout).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.procs import free_port

REPO = Path(__file__).resolve().parents[2]
USAGE = 2  # argparse's exit status, and the CLI's for an unknown job or an AM that does not answer
NOT_ENROLLED = 3  # elan worker: no AM answered
TRACE = "saxena:high:10"  # a small synthetic workload: simulate cases that get past parsing stay fast


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, str]]:
    """What the cases name: a garbage file, a directory, a port nothing listens on, a port something holds."""
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"{\xff not json")
    (tmp_path / "a-dir").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield {"garbage": str(garbage), "dir": str(tmp_path / "a-dir"), "free": str(free_port()),
               "taken": str(taken.getsockname()[1]), "home": str(tmp_path / "home"), "tmp": str(tmp_path)}


def elan(argv: list[str], places: dict[str, str], env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_elan.cli ARGV`` (``{name}`` in an argument → ``places[name]``) in a fresh process."""
    clean = {key: value for key, value in os.environ.items()
             if key not in ("ELAN_AM", "ELAN_JOB", "ELAN_SECRET_FILE", "ELAN_AM_ADDRESS")}
    clean.update({"ELAN_HOME": places["home"], **(env or {})})
    args = [arg.format(**places) for arg in argv]
    return subprocess.run([sys.executable, "-m", "lightning_elan.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=places["tmp"], env=clean)


def assert_refused(result: subprocess.CompletedProcess[str], code: int, message: str) -> None:
    """Exit ``code``, no traceback, and one ``error:`` line that holds ``message``."""
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode == code, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert message in errors[0], err


def check(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    assert_refused(elan(argv, places), code, message)


# ---------------------------------------------------------------------- elan run

RUN = ["run", "--nproc", "1", "--job", "j"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["run", "--job", "j", "--", "true"], USAGE, "required: --nproc"),
    (["run", "--nproc", "-1", "--job", "j", "--", "true"], USAGE, "argument --nproc: must be an integer in 1..4096"),
    (["run", "--nproc", "99999", "--job", "j", "--", "true"], USAGE, "argument --nproc: must be an integer in 1.."),
    ([*RUN, "--report-timeout", "nan", "--", "true"], USAGE, "argument --report-timeout: must be a number > 0"),
    ([*RUN, "--report-timeout", "inf", "--", "true"], USAGE, "--report-timeout: must be a finite number > 0"),
    ([*RUN, "--join-timeout", "inf", "--", "true"], USAGE, "argument --join-timeout: must be a finite number"),
    ([*RUN, "--term-grace=-inf", "--", "true"], USAGE, "argument --term-grace: must be a number > 0"),
    ([*RUN, "--devices", "tpu", "--", "true"], USAGE, "argument --devices: invalid choice: 'tpu'"),
    ([*RUN, "--standby", "99", "--", "true"], USAGE, "at most 64 standby workers"),
    ([*RUN, "--autoscale", "magic", "--", "true"], USAGE, "argument --autoscale: invalid choice: 'magic'"),
    ([*RUN, "--state-dir", "{garbage}", "--", "true"], USAGE, "cannot create the state directory"),
    ([*RUN, "--", "/no/such/program"], USAGE, "'/no/such/program' is not an executable file"),
    ([*RUN, "--secret-file", "/no/such/secret", "--", "true"], USAGE, "cannot read the secret file /no/such/secret"),
    (["run", "--nproc", "1", "--job", "../x", "--", "true"], USAGE, "invalid job name '../x'"),
])
def test_run_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)


# ---------------------------------------------------------------------- elan am

AM = ["am", "--job", "j"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["am"], USAGE, "required: --job"),
    ([*AM, "--bind", "127.0.0.1:notaport"], USAGE, "argument --bind: bad AM address '127.0.0.1:notaport'"),
    ([*AM, "--bind", "ipc:///tmp/am"], USAGE, "argument --bind: bad AM address 'ipc:///tmp/am'"),
    ([*AM, "--bind", "::1:80"], USAGE, "expected HOST:PORT, tcp://HOST:PORT or HOST"),
    ([*AM, "--bind", "127.0.0.1:99999"], USAGE, "the port must be a number in 0..65535"),
    ([*AM, "--bind", "127.0.0.1:{taken}"], USAGE, "cannot bind the AM to tcp://127.0.0.1:{taken}: Address already in"),
    ([*AM, "--lease-ttl", "nan"], USAGE, "argument --lease-ttl: must be a number > 0, got 'nan'"),
    ([*AM, "--lease-ttl", "inf", "--store", "etcd://127.0.0.1:{free}/x"], USAGE, "--lease-ttl: must be a finite"),
    ([*AM, "--store", "{garbage}"], USAGE, "cannot use the store {garbage}: "),
    ([*AM, "--store", "{dir}"], USAGE, "cannot use the store {dir}: Is a directory"),
    ([*AM, "--state-dir", "{garbage}"], USAGE, "cannot create the state directory {garbage}: File exists"),
    ([*AM, "--min-workers", "2", "--rdzv-port", "70000"], USAGE, "argument --rdzv-port: must be a port number"),
    ([*AM, "--min-workers", "0"], USAGE, "argument --min-workers: must be an integer in 1..4096"),
    ([*AM, "--min-workers", "2", "--join-timeout", "inf"], USAGE, "argument --join-timeout: must be a finite"),
    ([*AM, "--min-workers", "2", "--start-grace", "-1"], USAGE, "argument --start-grace: must be a number >= 0"),
    ([*AM, "--autoscale", "throughput", "--autoscale-cooldown", "inf"], USAGE, "--autoscale-cooldown: must be a fin"),
    ([*AM, "--straggler-threshold", "nan"], USAGE, "--straggler-threshold: must be a number in [0, 1)"),
    ([*AM, "--stragglers", "sometimes"], USAGE, "argument --stragglers: invalid choice: 'sometimes'"),
    ([*AM, "--autoscale", "utility", "--price", "1", "--utility", "{garbage}"], USAGE, "argument --utility"),
])
def test_am_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message.format(**places), places)


# ---------------------------------------------------------------------- elan worker

WORKER = ["worker", "--am", "127.0.0.1:{free}", "--job", "j"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["worker", "--job", "j", "--", "true"], USAGE, "the AM's address is needed"),
    (["worker", "--am", "127.0.0.1:{free}", "--", "true"], USAGE, "the job's name is needed"),
    (["worker", "--am", "http://h:1", "--job", "j", "--", "true"], USAGE, "argument --am: bad AM address"),
    (["worker", "--am", "h:1,,h:2", "--job", "j", "--", "true"], USAGE, "argument --am: bad AM address list"),
    ([*WORKER, "--enrol-timeout", "nan", "--", "true"], USAGE, "argument --enrol-timeout: must be a number > 0"),
    ([*WORKER, "--term-grace", "inf", "--", "true"], USAGE, "argument --term-grace: must be a finite number > 0"),
    ([*WORKER, "--device-index", "-1", "--", "true"], USAGE, "argument --device-index: must be a non-negative"),
    ([*WORKER, "--iface", "no-such-if0", "--", "true"], USAGE, "--iface 'no-such-if0': no such network interface"),
    ([*WORKER, "--enrol-timeout", "0.3", "--", "true"], NOT_ENROLLED,
     "no AM of job j answered at tcp://127.0.0.1:{free} within 0.3 s"),
])
def test_worker_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message.format(**places), places)


def test_worker_takes_its_am_address_from_elan_am_in_any_form(places: dict[str, str]) -> None:
    bad = elan(["worker", "--job", "j", "--", "true"], places, env={"ELAN_AM": "h:1:2"})
    assert_refused(bad, USAGE, "argument --am: bad AM address 'h:1:2'")
    nobody = elan(["worker", "--job", "j", "--enrol-timeout", "0.3", "--", "true"], places,
                  env={"ELAN_AM": f"127.0.0.1:{places['free']}"})
    assert_refused(nobody, NOT_ENROLLED, f"answered at tcp://127.0.0.1:{places['free']}")


# ---------------------------------------------------------------------- elan scale / status / profile / autoscale


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["scale", "--job", "j"], USAGE, "required: ACTION, ARG"),
    (["scale", "--job", "j", "grow", "1"], USAGE, "unknown action 'grow'"),
    (["scale", "--job", "j", "add", "-1"], USAGE, "count for 'add' must be an integer >= 1"),
    (["scale", "--job", "ghost", "add", "1"], USAGE, "no running job named ghost"),
    (["scale", "--job", "j", "--am", "h:", "add", "1"], USAGE, "argument --am: bad AM address 'h:'"),
    (["scale", "--job", "j", "--timeout", "inf", "add", "1"], USAGE, "argument --timeout: must be a finite number"),
    (["scale", "--job", "j", "--am", "127.0.0.1:{free}", "--timeout", "0.1", "add", "1"], USAGE, "does not answer"),
])
def test_scale_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["status"], USAGE, "required: --job"),
    (["status", "--job", "ghost"], USAGE, "no running job named ghost"),
    (["status", "--job", "j", "--timeout", "0"], USAGE, "argument --timeout: must be a number > 0, got '0'"),
    (["status", "--job", "j", "--timeout", "nan"], USAGE, "argument --timeout: must be a number > 0, got 'nan'"),
    (["status", "--job", "j", "--am", ","], USAGE, "argument --am: bad AM address list ','"),
    (["status", "--job", "j", "--am", "[zz]:1"], USAGE, "argument --am: bad AM address '[zz]:1'"),
    (["status", "--job", "j", "--am", "127.0.0.1:{free}", "--timeout", "0.1"], USAGE,
     "job j's AM at tcp://127.0.0.1:{free} does not answer"),
    (["status", "--job", "j", "--am", "localhost:{free}", "--timeout", "0.1"], USAGE, "does not answer"),
])
def test_status_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message.format(**places), places)


PROFILE = ["profile", "--job", "j", "--min", "1", "--max", "2"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["profile", "--job", "j", "--min", "1"], USAGE, "required: --max"),
    (["profile", "--job", "../x", "--min", "1", "--max", "2"], USAGE, "argument --job: invalid job name '../x'"),
    (["profile", "--job", "j", "--min", "0", "--max", "2"], USAGE, "argument --min: must be an integer in 1..4096"),
    (["profile", "--job", "j", "--min", "3", "--max", "2"], USAGE, "--min 3 is more than --max 2"),
    ([*PROFILE, "--steps", "0"], USAGE, "argument --steps: must be an integer >= 1, got '0'"),
    ([*PROFILE, "--settle", "never"], USAGE, "argument --settle: invalid choice: 'never'"),
    ([*PROFILE, "--timeout", "0"], USAGE, "argument --timeout: must be a number > 0, got '0'"),
    ([*PROFILE, "--wait-timeout", "inf"], USAGE, "argument --wait-timeout: must be a finite number >= 0"),
    ([*PROFILE, "--job", "ghost"], USAGE, "no running job named ghost"),
    ([*PROFILE, "--am", "127.0.0.1:{free}", "--timeout", "0.1"], USAGE, "does not answer"),
])
def test_profile_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)


AUTOSCALE = ["autoscale", "--job", "j", "--policy", "throughput"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["autoscale", "--job", "j"], USAGE, "required: --policy"),
    (["autoscale", "--job", "j", "--policy", "magic"], USAGE, "argument --policy: invalid choice: 'magic'"),
    (["autoscale", "--job", "../x", "--policy", "off"], USAGE, "argument --job: invalid job name '../x'"),
    ([*AUTOSCALE, "--timeout", "0"], USAGE, "argument --timeout: must be a number > 0, got '0'"),
    ([*AUTOSCALE, "--cooldown", "inf"], USAGE, "argument --cooldown: must be a finite number >= 0, got 'inf'"),
    ([*AUTOSCALE, "--price", "-1"], USAGE, "argument --price: must be a number >= 0, got '-1'"),
    ([*AUTOSCALE, "--threshold", "1"], USAGE, "argument --threshold: must be a number in [0, 1), got '1'"),
    ([*AUTOSCALE, "--min-workers", "3", "--max-workers", "2"], USAGE, "--min-workers 3 is more than --max-workers"),
    (["autoscale", "--job", "j", "--policy", "utility", "--price", "1", "--utility", "/no/such.json"], USAGE,
     "argument --utility: utility function '/no/such.json'"),
    ([*AUTOSCALE, "--job", "ghost"], USAGE, "no running job named ghost"),
    ([*AUTOSCALE, "--am", "127.0.0.1:{free}", "--timeout", "0.1"], USAGE, "does not answer"),
])
def test_autoscale_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)


# ---------------------------------------------------------------------- elan simulate

SIMULATE = ["simulate", "--trace", TRACE, "--cluster", "4", "--policy", "fifo"]


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["simulate", "--cluster", "4"], USAGE, "required: --trace"),
    (["simulate", "--trace", "/no/such.csv", "--cluster", "4"], USAGE, "trace file not found: /no/such.csv"),
    (["simulate", "--trace", "{garbage}", "--cluster", "4"], USAGE, "not a trace CSV"),
    (["simulate", "--trace", "saxena:nope", "--cluster", "4"], USAGE, "unknown arrival pattern 'nope'"),
    (["simulate", "--trace", TRACE, "--cluster", "-4"], USAGE, "cluster spec not found: -4"),
    ([*SIMULATE, "--policy", "nope"], USAGE, "unknown policy 'nope'"),
    ([*SIMULATE, "--adjust-cost", "{garbage}"], USAGE, "not JSON"),
    ([*SIMULATE, "--seed", "x"], USAGE, "argument --seed: invalid int value: 'x'"),
    ([*SIMULATE, "--dp-interval", "nan"], USAGE, "--dp-interval must be 0 (every event) or a positive number"),
    ([*SIMULATE, "--min-res-factor", "nan"], USAGE, "need 0 < --min-res-factor <= 1 <= --max-res-factor"),
    ([*SIMULATE, "--max-res-factor", "inf"], USAGE, "need 0 < --min-res-factor <= 1 <= --max-res-factor"),
    ([*SIMULATE, "--out", "{garbage}"], USAGE, "exists and is not a directory"),
])
def test_simulate_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)


def test_simulate_without_matplotlib_writes_the_reports_and_says_how_to_get_the_png(
        places: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked by this test')\n")
    out = tmp_path / "out"
    pythonpath = os.pathsep.join([str(blocker.parent), str(REPO), os.environ.get("PYTHONPATH", "")])
    result = elan([*SIMULATE, "--out", str(out)], places, env={"PYTHONPATH": pythonpath})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert sorted(path.name for path in out.iterdir()) == ["simulate.json", "simulate.md"]
    notes = result.stderr.strip().splitlines()
    assert len(notes) == 1 and "skipping simulate.png" in notes[0] and "pip install matplotlib" in notes[0], notes


# ---------------------------------------------------------------------- elan itself


@pytest.mark.parametrize(("argv", "code", "message"), [
    ([], USAGE, "required: COMMAND"),
    (["bogus"], USAGE, "invalid choice: 'bogus'"),
    (["status", "--job", "j", "--secret-file", "{garbage}"], USAGE, "the secret in"),
])
def test_elan_refuses_bad_input(argv: list[str], code: int, message: str, places: dict[str, str]) -> None:
    check(argv, code, message, places)
