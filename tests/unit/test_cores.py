"""The rule that lets tests share the cores under ``pytest -n``: a ``solo`` test runs alone and is not starved."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.cores import cores

WAIT_S = 0.3


def _enter(lock_dir: Path, alone: bool, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def hold() -> None:
        with cores(lock_dir, alone):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


def test_tests_share_the_cores_and_a_solo_test_waits_for_them(tmp_path: Path) -> None:
    first, second, solo = (threading.Event() for _ in range(3))
    leave_first, leave_second, leave_solo = (threading.Event() for _ in range(3))
    threads = [_enter(tmp_path, False, first, leave_first), _enter(tmp_path, False, second, leave_second)]
    assert first.wait(5) and second.wait(5), "two ordinary tests run side by side"
    threads.append(_enter(tmp_path, True, solo, leave_solo))
    assert not solo.wait(WAIT_S), "a solo test started beside running tests"
    leave_first.set()
    assert not solo.wait(WAIT_S), "a solo test started beside a running test"
    leave_second.set()
    assert solo.wait(5), "a solo test did not start once the others ended"
    leave_solo.set()
    for thread in threads:
        thread.join(5)


def test_a_waiting_solo_test_goes_before_tests_that_start_later(tmp_path: Path) -> None:
    running, solo, later = (threading.Event() for _ in range(3))
    leave_running, leave_solo, leave_later = (threading.Event() for _ in range(3))
    threads = [_enter(tmp_path, False, running, leave_running)]
    assert running.wait(5)
    threads.append(_enter(tmp_path, True, solo, leave_solo))
    assert not solo.wait(WAIT_S)
    threads.append(_enter(tmp_path, False, later, leave_later))
    assert not later.wait(WAIT_S), "a test started while a solo test waited for its turn"
    leave_running.set()
    assert solo.wait(5) and not later.is_set(), "the solo test did not go first"
    leave_solo.set()
    assert later.wait(5)
    leave_later.set()
    for thread in threads:
        thread.join(5)
