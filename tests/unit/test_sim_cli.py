"""``elan simulate`` through the real command line: bad input is one ``elan: error: simulate: …`` line and exit
status 2 (never a traceback); model profiles and cost tables from files; --out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_elan.cli import main
from lightning_elan.sim import SHIPPED_TRACE

REPO = Path(__file__).resolve().parents[2]
HEADER = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
TRACE = str(SHIPPED_TRACE)


def elan_simulate(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_elan.cli simulate ARGV`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "lightning_elan.cli", "simulate", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("elan: error: simulate: ") and message in lines[0], err


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Bad inputs of every kind, by name."""
    made = {
        "garbage": b"\x89PNG\r\n\x1a\n\xff\xfe\xb9\x00 not a csv \xc3\x28",
        "empty": b"",
        "wrong_header": b"id,gpus,submit\n1,2,3\n",
        "short_line": (HEADER + "0,1,0,6,vgg19,164\n").encode(),
        "bad_number": (HEADER + "0,1,0,6,vgg19,164,30\n1,two,30,133,vgg11,147,23\n").encode(),
        "nan_duration": (HEADER + "0,1,0,6,vgg19,nan,30\n").encode(),
        "zero_gpus": (HEADER + "0,0,0,6,vgg19,164,30\n").encode(),
        "unknown_model": (HEADER + "0,1,0,6,transformer,164,30\n").encode(),
        "duplicate_id": (HEADER + "0,1,0,6,vgg19,164,30\n0,1,5,6,vgg19,164,30\n").encode(),
        "header_only": HEADER.encode(),
        "spec_garbage": b"\xff\xfe\x00\x01\x02",
        "spec_wrong_header": b"switches,nodes,gpus\n1,2,4\n",
        "spec_bad_number": b"num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,four,4,128,256\n",
        "spec_zero": b"num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,0,4,128,256\n",
        "cost_not_json": b'{"points": [',
        "cost_no_points": b'{"points": []}',
        "cost_negative": b'{"points": [{"parameters": 1000, "scale_out": -1, "scale_in": 0, "migrate": 0}]}',
        "profile_not_json": b"resnet50: fast",
        "profile_bad_entry": b'{"resnet50": {"parameters": 25600000}}',
    }
    paths = {}
    for name, content in made.items():
        path = tmp_path / f"{name}.csv"
        path.write_bytes(content)
        paths[name] = str(path)
    paths["directory"] = str(tmp_path)
    (tmp_path / "a_file").write_text("x")
    paths["a_file"] = str(tmp_path / "a_file")
    return paths


BAD_INPUT = [
    # (argv with {name} placeholders for the fixture's files, the message the one error line contains)
    (["--trace", "{missing}", "--cluster", "8"], "trace file not found"),
    (["--trace", "{directory}", "--cluster", "8"], "trace file not found"),
    (["--trace", "{garbage}", "--cluster", "8"], "not a trace CSV (not UTF-8 text)"),
    (["--trace", "{empty}", "--cluster", "8"], ":1: header must be job_id,num_gpu"),
    (["--trace", "{wrong_header}", "--cluster", "8"], ":1: header must be job_id,num_gpu"),
    (["--trace", "{header_only}", "--cluster", "8"], ": no jobs"),
    (["--trace", "{short_line}", "--cluster", "8"], ":2: expected 7 fields, got 6"),
    (["--trace", "{bad_number}", "--cluster", "8"], ":3: malformed line"),
    (["--trace", "{nan_duration}", "--cluster", "8"], ":2: submit_time, duration and interval must be finite"),
    (["--trace", "{zero_gpus}", "--cluster", "8"], ":2: need num_gpu >= 1"),
    (["--trace", "{unknown_model}", "--cluster", "8"], "no profile for model 'transformer'"),
    (["--trace", "{duplicate_id}", "--cluster", "8"], "duplicate job_id"),
    (["--trace", "saxena:sometimes", "--cluster", "40"], "unknown arrival pattern 'sometimes'"),
    (["--trace", "saxena:bursty:soon", "--cluster", "40"], "minutes must be a number"),
    (["--trace", "saxena:bursty:-5", "--cluster", "40"], "must be positive minutes"),
    (["--trace", "saxena:bursty:120", "--cluster", "40", "--profiles", "{a_file}"], "Saxena's workload has its own"),
    (["--trace", "saxena:bursty:120", "--cluster", "4"], "the cluster has 4 (Saxena's jobs ask for up to kmax = 10)"),
    (["--trace", TRACE, "--cluster", "4"], "asks for 8 GPUs; the cluster has 4"),
    (["--trace", TRACE, "--cluster", "0"], "at least one GPU"),
    (["--trace", TRACE, "--cluster", "0x4"], "at least one GPU"),
    (["--trace", TRACE, "--cluster", "99999999999"], "more than this simulator takes"),
    (["--trace", TRACE, "--cluster", "lots"], "cluster spec not found: lots (--cluster takes"),
    (["--trace", TRACE, "--cluster", "{directory}"], "cluster spec not found"),
    (["--trace", TRACE, "--cluster", "{spec_garbage}"], "not a cluster spec CSV (not UTF-8 text)"),
    (["--trace", TRACE, "--cluster", "{spec_wrong_header}"], "expected the header num_switch"),
    (["--trace", TRACE, "--cluster", "{spec_bad_number}"], ":2: malformed line"),
    (["--trace", TRACE, "--cluster", "{spec_zero}"], ":2: need 5 fields and positive counts"),
    (["--trace", TRACE, "--cluster", "8", "--policy", "fifo,sjf"], "unknown policy 'sjf' (one of fifo, backfill"),
    (["--trace", TRACE, "--cluster", "8", "--policy", "FIFO"], "unknown policy 'FIFO'"),
    (["--trace", TRACE, "--cluster", "8", "--policy", ","], "--policy needs at least one policy name"),
    (["--trace", TRACE, "--cluster", "8", "--adjust-cost", "cheap"], "neither elan, restart, none nor a file"),
    (["--trace", TRACE, "--cluster", "8", "--adjust-cost", ","], "--adjust-cost needs at least one cost model"),
    (["--trace", TRACE, "--cluster", "8", "--adjust-cost", "{cost_not_json}"], "not JSON"),
    (["--trace", TRACE, "--cluster", "8", "--adjust-cost", "{cost_no_points}"], "at least one point"),
    (["--trace", TRACE, "--cluster", "8", "--adjust-cost", "{cost_negative}"], "non-negative pauses"),
    (["--trace", TRACE, "--cluster", "8", "--profiles", "{missing}"], "profile file not found"),
    (["--trace", TRACE, "--cluster", "8", "--profiles", "{profile_not_json}"], "not a profile JSON"),
    (["--trace", TRACE, "--cluster", "8", "--profiles", "{profile_bad_entry}"], "not a profile JSON"),
    (["--trace", TRACE, "--cluster", "8", "--min-res-factor", "0"], "need 0 < --min-res-factor <= 1"),
    (["--trace", TRACE, "--cluster", "8", "--max-res-factor", "0.5"], "<= --max-res-factor"),
    (["--trace", TRACE, "--cluster", "8", "--dp-interval", "-1"], "--dp-interval must be 0"),
    (["--trace", TRACE, "--cluster", "8", "--out", "{a_file}"], "exists and is not a directory"),
    (["--trace", TRACE, "--cluster", "8", "--out", "{a_file}/below"], "cannot create the directory"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT, ids=[message for _, message in BAD_INPUT])
def test_bad_input_is_one_error_line_and_status_2(
    argv: list[str], message: str, files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {**files, "missing": str(tmp_path / "missing.csv")}
    code, out, err = run_main([arg.format(**files) for arg in argv], capsys)
    assert_one_line_error(code, err, message)
    assert out == ""  # nothing simulated, no table


def test_bad_input_through_a_real_process(files: dict[str, str]) -> None:
    """The same in a fresh interpreter, as a user runs it: status 2 and one line on stderr, no traceback."""
    for argv, message in [
        (["--trace", files["garbage"], "--cluster", "8"], "not a trace CSV"),
        (["--trace", "no/such/trace.csv", "--cluster", "8"], "trace file not found: no/such/trace.csv"),
        (["--trace", TRACE, "--cluster", "8", "--policy", "fifo,lottery"], "unknown policy 'lottery'"),
        (["--trace", TRACE, "--cluster", files["spec_garbage"]], "not a cluster spec CSV"),
        (["--trace", TRACE, "--cluster", "8x"], "cluster spec not found: 8x"),
    ]:
        completed = elan_simulate(*argv)
        assert_one_line_error(completed.returncode, completed.stderr, message)
        assert completed.stdout == ""


def test_missing_required_option_is_argparse_usage_error() -> None:
    completed = elan_simulate("--trace", TRACE)
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert "the following arguments are required: --cluster" in completed.stderr


def test_tiresias_cluster_spec_file_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    spec = SHIPPED_TRACE.parent / "tiresias_n1g4.csv"  # 1 switch × 1 node × 4 GPUs: too small for 8-GPU jobs
    code, _, err = run_main(["--trace", TRACE, "--cluster", str(spec), "--policy", "fifo"], capsys)
    assert_one_line_error(code, err, "asks for 8 GPUs; the cluster has 4")
    spec = SHIPPED_TRACE.parent / "tiresias_n32g4.csv"  # 128 GPUs: nothing queues
    code, out, err = run_main(["--trace", TRACE, "--cluster", str(spec), "--policy", "fifo"], capsys)
    assert code == 0, err
    assert "| fifo | elan |" in out


def test_cost_table_from_a_file_is_charged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--adjust-cost FILE: a table with a 100 s pause makes every elastic resize cost 100 s of progress."""
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"points": [{"parameters": 1, "scale_out": 100, "scale_in": 100, "migrate": 100}]}))
    out_dir = tmp_path / "out"
    code, _, err = run_main(["--trace", TRACE, "--cluster", "16", "--policy", "e-fifo", "--adjust-cost",
                             f"none,{slow}", "--out", str(out_dir), "--no-png"], capsys)
    assert code == 0, err
    runs = {run["metrics"]["cost_model"]: run for run in json.loads((out_dir / "simulate.json").read_text())["runs"]}
    assert set(runs) == {"none", "slow.json"}
    slow_run = runs["slow.json"]["metrics"]
    assert slow_run["adjustments"] > 0
    paused = [job["pause_s"] for job in runs["slow.json"]["jobs"] if job["adjustments"]]
    assert paused and all(pause >= 100 - 1e-6 for pause in paused)
    assert slow_run["mean_jct_s"] > runs["none"]["metrics"]["mean_jct_s"]


def test_profiles_file_replaces_a_model_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--profiles: a model ten times slower per sample than the default does not change static run times (work
    is calibrated so a job takes its trace duration on its request) but changes how well it scales."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"vgg19": {"parameters": 143_700_000, "per_sample_s": 0.048}}))
    for extra in ([], ["--profiles", str(profiles)]):
        out_dir = tmp_path / ("custom" if extra else "default")
        code, _, err = run_main(["--trace", TRACE, "--cluster", "16", "--policy", "fifo,e-fifo", "--out",
                                 str(out_dir), "--no-png", *extra], capsys)
        assert code == 0, err
    default, custom = (json.loads((tmp_path / name / "simulate.json").read_text())["runs"]
                       for name in ("default", "custom"))
    assert default[0]["metrics"] == custom[0]["metrics"]  # fifo: durations from the trace
    assert default[1]["metrics"] != custom[1]["metrics"]  # e-fifo: a compute-bound vgg19 gains from more GPUs


def test_out_directory_is_created_with_all_three_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "new" / "nested"
    completed = elan_simulate("--trace", TRACE, "--cluster", "8", "--policy", "fifo,e-fifo", "--out", str(out_dir))
    assert completed.returncode == 0, completed.stderr
    assert sorted(path.name for path in out_dir.iterdir()) == ["simulate.json", "simulate.md", "simulate.png"]
    assert (out_dir / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| e-fifo | elan |" in completed.stdout
