"""``prepare_main_first.py``: the main process prepares and caches the features inside
``accelerator.main_process_first()`` (3–4 s here), the others load the cache after it; DDP told of unused parameters,
a ``GradientAccumulationPlugin``, Accelerate's in-order logger, ``split_between_processes`` in the evaluation.

* Joiners queued at launch start with the members and reach ``main_process_first`` while the main process is still
  preparing: they wait there until the members are in their loop (before, they read a cache not written yet: a
  ``FileNotFoundError`` traceback, the request dropped). Exact against the static run.
* A member SIGKILLed in ``main_process_first`` — the main process inside its block, or the other waiting for it — is
  recovered from before the loop (before, the survivor met the death in ``torch.distributed.barrier``: a traceback):
  the survivor prepares if the main process did not, a replacement joins, exact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_adjustments,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    assert_steps_applied_once,
    final_model,
    logged_steps,
    run_job,
)

pytestmark = pytest.mark.integration

SCRIPT, SAMPLES, EPOCHS, STEPS = "prepare_main_first.py", 96, 3, 24  # 8 steps of 2 micro-batches per epoch
PREPARE = ("--prepare_seconds", "4")


def prepare_log(run: Run) -> list[tuple[str, int, int]]:
    lines = (run.out / "prepare.log").read_text().split("\n")
    return [(kind, int(index), int(pid)) for kind, index, pid in (line.split() for line in lines if line)]


def check_trained(run: Run, static: Run | None) -> None:
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert_each_sample_once(run.trained(), SAMPLES, EPOCHS)
    assert_steps_applied_once(run.trained(), range(STEPS))
    assert sorted(logged_steps(run.metrics(), "train_loss")) == list(range(STEPS))
    assert list((run.out / "cache").iterdir()) == [run.out / "cache" / "features.pt"]  # no partial file left
    if static is not None:
        assert_states_close(final_model(run), final_model(static), where="final")
        errors = {line["epoch"]: line["eval_error"] for line in logged_steps(run.metrics(), "eval_error").values()}
        expected = {line["epoch"]: line["eval_error"] for line in logged_steps(static.metrics(), "eval_error").values()}
        assert errors.keys() == expected.keys()
        for epoch, error in expected.items():
            assert abs(errors[epoch] - error) <= 1e-9, (epoch, errors[epoch], error)


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("firststatic", SCRIPT, PREPARE))
    check_trained(run, None)
    return run


def test_joiners_started_at_launch_wait_for_the_main_process_to_prepare(static: Run, tmp_path: Path) -> None:
    run = run_job(tmp_path, Job("firstjoin", SCRIPT, PREPARE, schedule="3:add=1,6:remove=rank:0,9:migrate=1"))
    check_trained(run, static)
    assert_adjustments(run, [("add", 3), ("remove", 2), ("migrate", 2)])
    log = prepare_log(run)
    main_left = log.index(("leave", 0, next(pid for kind, index, pid in log if (kind, index) == ("enter", 0))))
    joiners = {pid for kind, _, pid in log} - {pid for kind, index, pid in log[:2]}
    assert len(joiners) == 2, log
    for kind, _, pid in log[:main_left]:
        assert not (kind == "leave" and pid in joiners), f"a joiner left main_process_first before the main: {log}"


def kill_in_main_process_first(run_dir: Path, victim_index: int, stop: threading.Event) -> None:
    """SIGKILL the member of ``victim_index`` once both members are in ``main_process_first`` (the main process
    preparing, the other waiting for it)."""
    log = run_dir / "out" / "prepare.log"
    while not stop.is_set():
        entered = {}
        if log.exists():
            entered = {int(index): int(pid) for kind, index, pid in (line.split() for line in
                                                                     log.read_text().splitlines()) if kind == "enter"}
        if {0, 1} <= entered.keys():
            time.sleep(1.0)  # well inside the main's 4 s of preparing
            os.kill(entered[victim_index], signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["main_preparing", "other_waiting"])
def test_a_member_killed_in_main_process_first_is_recovered_from(static: Run, tmp_path: Path, victim: str) -> None:
    stop = threading.Event()
    killer = threading.Thread(target=kill_in_main_process_first,
                              args=(tmp_path, 0 if victim == "main_preparing" else 1, stop), daemon=True)
    killer.start()
    try:
        run = run_job(tmp_path, Job(f"first{victim[:4]}", SCRIPT, PREPARE, replace_failed=True,
                                    env=(("USERS_HOLD", "1"),)))  # rank 0 holds until the replacement is ready
    finally:
        stop.set()
        killer.join()
    check_trained(run, static)
    actions = [adjustment["action"] for adjustment in run.adjustments()]
    assert actions[0] == "failure" and "add" in actions, actions
