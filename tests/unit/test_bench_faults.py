"""The crash-recovery benchmark's analysis (bench/faults.py) on hand-made step files."""

from __future__ import annotations

import pytest

from bench.analysis import ProcessSteps, StepRecord
from bench.faults import KillEvent, analyse_run


def process(pid: int, worker: str, start: float, steps: list[tuple[int, float, int]]) -> ProcessSteps:
    return ProcessSteps(pid, worker, "w", start - 1.0, start, [StepRecord(s, t, w, 0) for s, t, w in steps])


def test_torchrun_kill_counts_the_restarted_workers_and_the_redone_steps():
    old = [process(10 + r, str(r), 0.0, [(s, float(s), 3) for s in range(1, 16)]) for r in range(3)]
    # killed at t=15.5 after step 15; new workers start at 20 and resume from the checkpoint of step 10
    new = [process(20 + r, str(r), 20.0, [(s, 30.0 + s - 11, 3) for s in range(11, 20)]) for r in range(3)]
    event = KillEvent(0, 11, "1", 1, 3, 15.5)
    [kill] = analyse_run("torchrun", old + new, [event])
    assert kill.last_step == 15 and kill.next_step == 11 and kill.redone_steps == 5
    assert kill.recovery_s == pytest.approx(30.0 - 15.5)
    assert kill.progress_s == pytest.approx(35.0 - 15.5)  # step 16
    assert kill.respawn_s == pytest.approx(19.0 - 15.5)
    assert kill.typical_step_s == pytest.approx(1.0)


def test_elan_kill_skips_the_in_flight_step_of_the_old_generation():
    dead = process(11, "w1", 0.0, [(s, float(s), 3) for s in range(1, 11)])
    # a survivor finishes step 11 (all-reduce done before the kill) at world 3, then the new generation (world 2)
    # redoes nothing and completes step 12 at t=13
    survivor = process(10, "w0", 0.0, [*((s, float(s), 3) for s in range(1, 12)), (12, 13.0, 2), (13, 13.5, 2)])
    event = KillEvent(0, 11, "w1", 1, 3, 10.5)
    [kill] = analyse_run("elan", [dead, survivor], [event])
    assert kill.next_step == 12 and kill.redone_steps == 0
    assert kill.recovery_s == pytest.approx(2.5) and kill.progress_s == pytest.approx(2.5)
    assert kill.respawn_s is None


def test_a_job_that_never_came_back_has_no_recovery_time():
    worker = process(10, "w0", 0.0, [(s, float(s), 3) for s in range(1, 6)])
    [kill] = analyse_run("elan", [worker], [KillEvent(0, 11, "w1", 1, 3, 5.5)])
    assert kill.last_step == 5 and kill.recovery_s is None and kill.progress_s is None
