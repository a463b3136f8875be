"""A dead worker's shared-memory segments are removed by its launcher; nobody else's are touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from lightning_elan.launcher.segments import remove_segments_of


def test_the_segments_of_a_worker_killed_by_sigkill_are_removed(tmp_path: Path) -> None:
    """A real process makes a segment named as the engine names them and is SIGKILLed: only its segment goes."""
    code = ("import os, sys, time; open(os.path.join(sys.argv[1], f'elan-{os.getpid()}-0a1b2c'), 'w').write('x');"
            "print('made', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().strip() == b"made"
    other = tmp_path / f"elan-{os.getpid()}-ffffff"  # a live process's segment
    other.write_text("y")
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()

    removed = remove_segments_of(child.pid, {"ELAN_SHM_DIR": str(tmp_path)})
    assert [path.name for path in removed] == [f"elan-{child.pid}-0a1b2c"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [other.name]


def test_a_pid_whose_number_is_a_prefix_of_another_is_not_confused(tmp_path: Path) -> None:
    (tmp_path / "elan-123-aa").write_text("")
    (tmp_path / "elan-1234-bb").write_text("")
    assert [path.name for path in remove_segments_of(123, {"ELAN_SHM_DIR": str(tmp_path)})] == ["elan-123-aa"]
    assert [path.name for path in tmp_path.iterdir()] == ["elan-1234-bb"]
