"""Gradient accumulation by hand, as Accelerate's guide shows it without ``accumulate()`` (user loop
``accelerate_manual_accumulation_loop.py``: ``no_sync`` on every first micro-batch of two, picked by the loop's own
``enumerate`` counter), under the real `elan run --nproc 2 --replace-failed`: w1 is SIGKILLed between the two
micro-batches of step 6, after its ``no_sync`` backward. The survivor meets the death in the window's gradient
all-reduce, redoes the whole window from its first batch (where the user's counter starts its next window), and the
replacement joins at a step boundary: the final model equals a plain 2-process Accelerate run's, every sample once.

On the old code the survivor met the death at the batch boundary inside the window (its coordination) and recovered
there: the redo re-yielded the window's first batch while the user's counter went on, so every later window straddled
two steps (without a replacement: exit 0, the first layer's weights summing to -2.5107 instead of the plain run's
-2.5072), and the replacement, admitted later, started its counter at 0, out of step with the survivor's shifted one:
a synced backward against a ``no_sync`` one, the job hung (this test: timed out after 60 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import committed_batches
from tests.integration.elastic_runs import (
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_states_close,
    elan_env,
    free_port,
)

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_manual_accumulation_loop.py")
SAMPLES, EPOCHS, STEPS = 96, 3, 18  # 12 global batches of 8 per epoch, two per step
KILLED_IN_STEP = 6


def plain_run(tmp: Path) -> RunResult:
    """The loop with a plain ``Accelerator`` on 2 processes started as torchrun starts them."""
    out = tmp / "plain"
    base = {**elan_env(tmp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(LOOP), str(out), "--plain"],
                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    output = "\n".join(proc.communicate(timeout=120)[0] for proc in procs)
    return RunResult(out, tmp / "plain-state", max(proc.returncode for proc in procs), output)


def elastic_run(tmp: Path) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "manual",
               "--coordinate-every", "1", "--state-dir", str(tmp / "manual-state"), "--replace-failed", "--",
               sys.executable, str(LOOP), str(tmp / "manual"), "--kill", f"w1:{KILLED_IN_STEP - 1}", "--pause", "0.1"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=elan_env(tmp))
    except subprocess.TimeoutExpired as expired:
        output = b"".join(part for part in (expired.stdout, expired.stderr) if isinstance(part, bytes))
        pytest.fail(f"the job hung:\n{output.decode(errors='replace')[-4000:]}")
    return RunResult(tmp / "manual", tmp / "manual-state", proc.returncode, proc.stdout + proc.stderr)


def test_a_member_killed_inside_a_no_sync_window_is_redone_exactly(tmp_path):
    plain = plain_run(tmp_path)
    assert plain.returncode == 0, plain.output[-3000:]
    run = elastic_run(tmp_path)
    assert run.returncode == 0, run.excerpt()
    assert f"after the death of w1 (step {KILLED_IN_STEP} redone)" in run.output, run.excerpt()
    assert_counted_once(committed_batches(run), SAMPLES, EPOCHS)
    assert_states_close(run.final_state(), plain.final_state(), TOLERANCE)
    records = {path.stem: json.loads(path.read_text()) for path in run.out.glob("record-*.json")}
    assert records["record-w0"]["steps"] == STEPS
    adjustments = run.adjustments()
    assert adjustments[0]["failure"]["dead"] == ["w1"]
    joined = [adjustment for adjustment in adjustments if adjustment.get("joiners") == ["w2"]]
    if joined:  # the replacement joined before the job's end (else its record says it trained nothing)
        assert records["record-w2"]["steps"] == STEPS
